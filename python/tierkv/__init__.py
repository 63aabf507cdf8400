# SPDX-License-Identifier: Apache-2.0
"""tierkv: torch custom ops over tierkv's tiered, paged KV cache (host path).

Importing it loads the compiled ops (torch.ops.tierkv.*) and their fake implementations.
tierkv.transformers (imported on its own) holds the transformers Cache.
"""

import torch

from . import _C  # noqa: F401  (loads the library: registers torch.ops.tierkv)
from . import _fake  # noqa: F401
from .cache import RETIER_FIELDS, Cache, built, seq_tensor
from .wrappers import BatchDecodeWrapper, BatchPrefillWrapper

ops = torch.ops.tierkv

__all__ = ["Cache", "BatchDecodeWrapper", "BatchPrefillWrapper", "built", "ops", "seq_tensor", "RETIER_FIELDS"]
