"""What every backend's `step()` returns (see docs/architecture.md, "The backend step interface")."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepOutput:
    tokens: np.ndarray  # int32 [S] sampled token per sampling row
    logprobs: np.ndarray  # float32 [S] log-softmax (raw logits) of the sampled token
    top_ids: np.ndarray | None = None  # int32 [S, N] when num_logprobs > 0
    top_logprobs: np.ndarray | None = None  # float32 [S, N]
    logits: np.ndarray | None = None  # float32 [S, V] when return_logits
