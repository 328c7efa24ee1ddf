"""docs/serving.md and the README held to the code: the flag table (every flag, each default), the
routes, the metric table (every series and its type), the environment variables, the presets' sizes."""
import argparse
import dataclasses
import re
from types import SimpleNamespace

from cli_util import ROOT
from openinfer.cli import build_parser, flag_of
from openinfer.config import ENV_VARS, EngineConfig, ServerConfig
from openinfer.server.metrics import Metrics
from openinfer.server.routes import routes
from openinfer.tools.random_checkpoint import PRESETS, _size, disk_bytes

SERVING = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else None]


def table(text: str) -> list[list[str]]:
    """The rows of the markdown tables in `text`, as cells, header rows left out."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]


def test_flag_table_is_every_flag_with_its_default():
    rows = {r[0].strip("`"): r[1] for r in table(section(SERVING, "## Flags"))}
    flags = {a.option_strings[0] for a in build_parser()._actions
             if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._StoreConstAction))}
    assert set(rows) == flags - {"--version"}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.init and not f.metadata.get("hidden") and f.default is not None:
                shown = str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
                assert rows[flag_of(f.name)] == shown, f.name


def test_every_route_is_listed():
    listed = section(SERVING, "## Endpoints")
    for r in routes():
        for m in r.methods - {"HEAD"}:
            assert f"`{m} {r.path.replace('{model:path}', '{id}')}`" in listed, (m, r.path)


def test_metric_table_is_what_the_server_exposes():
    idle = SimpleNamespace(stats={}, alive=True, step_count=0, busy_seconds=0.0)
    text = Metrics(idle, "m").render().decode()
    exposed = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if not name.endswith("_created"):  # the client's creation timestamps of the histograms
            exposed[name if kind != "counter" or name.endswith("_total") else name + "_total"] = kind
    documented = {r[0].strip("`"): r[1] for r in table(section(SERVING, "## Metrics (`/metrics`)"))}
    assert documented == exposed


def test_environment_variables_are_documented():
    rows = {r[0].strip("`") for r in table(section(SERVING, "## Environment variables"))}
    assert rows == set(ENV_VARS)


def test_readme_preset_sizes():
    for p in PRESETS:
        assert f"`{p}` ({_size(disk_bytes(p))})" in README, p
