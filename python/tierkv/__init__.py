# SPDX-License-Identifier: Apache-2.0
"""tierkv: torch custom ops over tierkv's tiered, paged KV cache.

Importing it loads the host ops (torch.ops.tierkv.*, tierkv.Cache) and their fake
implementations, and registers the GPU ops (tierkv.CudaCache, torch.ops.tierkv.cuda_*), whose
library loads when the first CudaCache is made. tierkv.transformers (imported on its own) holds
the transformers Cache.
"""

import torch

from . import _C  # noqa: F401  (loads the library: registers torch.ops.tierkv)
from . import _fake  # noqa: F401
from .cache import RETIER_FIELDS, Cache, built, policies, seq_tensor
from .cuda import CudaCache
from .wrappers import BatchDecodeWrapper, BatchPrefillWrapper

ops = torch.ops.tierkv

__all__ = ["Cache", "CudaCache", "BatchDecodeWrapper", "BatchPrefillWrapper", "built", "ops", "policies", "seq_tensor", "RETIER_FIELDS"]
