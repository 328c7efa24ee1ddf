"""`openinfer-serve`: the OpenAI-compatible server on one model directory."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

log = logging.getLogger("openinfer")

NOT_BUILT = {  # flag -> what it would do; refused rather than silently ignored
    "kv_offload": "--kv-offload (host-memory KV tier)",
    "kv_offload_host_gib": "--kv-offload-host-gib (host-memory KV tier size)",
    "dflash_draft_model_path": "--dflash-draft-model-path (DFlash speculative decoding)",
}


def _bool(v: str) -> bool:
    if v.lower() in ("true", "1", "yes", "on"):
        return True
    if v.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openinfer-serve",
        description="Serve a Qwen3 model directory over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                    "/tokenize, /detokenize).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model-path", default="models/Qwen3-4B",
      help="Hugging Face model directory (config.json, safetensors, tokenizer files)")
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    a("--port", type=int, default=8000, help="TCP port to listen on")
    a("--served-model-name", default=None,
      help="model name clients must send in 'model' (default: the model directory's name)")
    a("--device", choices=("cuda", "cpu"), default="cuda",
      help="cuda: the CUDA engine; cpu: the NumPy reference backend (small models only)")
    a("--load-format", choices=("safetensors", "random"), default="safetensors",
      help="safetensors: load the checkpoint; random: seeded random weights from config.json alone "
           "(benchmarks, trying the server without a download)")
    a("--gpu-memory-utilization", type=float, default=0.90,
      help="fraction of GPU memory the engine may use (weights + activations + KV cache)")
    a("--max-model-len", type=int, default=None,
      help="longest prompt + completion in tokens (default: the model's, capped at 40960)")
    a("--max-num-seqs", type=int, default=256, help="most requests decoded in one step")
    a("--max-num-batched-tokens", type=int, default=8192,
      help="token budget of one step (decode rows plus prefill chunks)")
    a("--max-waiting-requests", type=int, default=1024,
      help="bound of the waiting queue; beyond it requests get 503 with Retry-After")
    a("--cuda-graph", type=_bool, default=True, metavar="{true,false}",
      help="replay decode steps from captured CUDA graphs")
    a("--pdl", type=_bool, default=True, metavar="{true,false}",
      help="programmatic dependent launch: a kernel starts while the previous one ends (sm_90+)")
    a("--gemm-autotune", type=_bool, default=True, metavar="{true,false}",
      help="time cuBLASLt algorithms for the decode shapes at start-up (false: the same algorithms, and so the same "
           "output bits, on every start)")
    a("--overlap-steps", type=_bool, default=True, metavar="{true,false}",
      help="launch each step before the previous one's tokens reach the host, so scheduling and "
           "streaming run while the GPU works")
    a("--no-prefix-cache", action="store_true",
      help="turn off prefix caching (reuse of KV blocks across requests sharing a prompt prefix)")
    a("--kv-offload", action="store_true",
      help="keep a host-memory copy of KV blocks for prefix hits (NOT BUILT YET: refused)")
    a("--kv-offload-host-gib", type=float, default=None,
      help="size of the host KV tier in GiB (NOT BUILT YET: refused)")
    a("--dflash-draft-model-path", default=None,
      help="DFlash draft model directory for speculative decoding (NOT BUILT YET: refused)")
    a("--seed", type=int, default=0, help="engine seed (random weights, unseeded requests)")
    a("--api-key", default=None,
      help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize")
    a("--max-body-mib", type=float, default=8, help="largest request body accepted (413 beyond)")
    a("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"),
      help="log level of the server and the engine")
    return p


def engine_config(args: argparse.Namespace):
    """The EngineConfig the parsed flags describe (validated by EngineConfig itself)."""
    from .config import EngineConfig
    return EngineConfig(model_path=args.model_path, device=args.device, load_format=args.load_format,
                        seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_waiting=args.max_waiting_requests,
                        enable_prefix_caching=not args.no_prefix_cache, cuda_graph=args.cuda_graph,
                        overlap_steps=args.overlap_steps, pdl=args.pdl,
                        gemm_autotune=args.gemm_autotune)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, what in NOT_BUILT.items():
        if getattr(args, name) not in (None, False):
            print(f"openinfer-serve: {what} is not built yet", file=sys.stderr)
            return 2

    from .config import check_model_dir
    try:
        check_model_dir(args.model_path)
    except FileNotFoundError as e:
        print(f"openinfer-serve: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from .engine import LLMEngine
    from .server import build_app

    try:
        cfg = engine_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"openinfer-serve: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(cfg)
    except (RuntimeError, ValueError, FileNotFoundError) as e:  # no GPU, no CUDA engine, bad weights
        print(f"openinfer-serve: cannot start the engine: {e}", file=sys.stderr)
        return 1
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_path))
    log.info("engine ready in %.1f s (device=%s, max_model_len=%s)", time.perf_counter() - t0,
             args.device, cfg.max_model_len)
    app = build_app(engine, served_model_name=name, api_key=args.api_key,
                    max_body_bytes=int(args.max_body_mib * (1 << 20)))

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                log.info("serving '%s' on http://%s:%d: ready %.1f s after start", name,
                         args.host, args.port, time.perf_counter() - t0)

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port,
                                    log_level=args.log_level, timeout_graceful_shutdown=5))
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
