"""Our top-level `kernels` package must not pass for the Hugging Face `kernels` hub package.

`transformers` asks whether "kernels" is importable and, if it is and its version fits, imports
hub-kernel helpers from it and swaps layer forwards for them. Ours is importable (same name), so
the guard that holds is the version check: `transformers` resolves the version of the
distribution that ships the name — ours, `tandem-serve` — and finds it outside the range it
accepts. Were that ever to pass, `transformers` would import names our package does not have.

Checked in a fresh interpreter, because `transformers` caches these answers per process.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys, tempfile
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations import hub_kernels
from transformers.utils import import_utils

ours = sys.argv[1]
calls = []

def record(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(ours):
        calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
sys.setprofile(record)
torch.manual_seed(0)
with tempfile.TemporaryDirectory() as folder:
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
sys.setprofile(None)
print(json.dumps({
    "kernels_available": import_utils.is_kernels_available(),
    "hub_helper_module": hub_kernels.use_kernel_forward_from_hub.__module__,
    "calls_into_ours": calls,
    "generated": tokens.shape[1],
}))
"""


def test_transformers_does_not_take_our_kernels_for_the_hub_package(repo_root):
    ours = str(repo_root / "kernels")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, ours], cwd=repo_root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kernels_available"] is False
    # The hub helpers are transformers' own no-op fallbacks, not names imported from a `kernels` package.
    assert report["hub_helper_module"] == "transformers.integrations.hub_kernels"
    # Loading and running a Llama never executes a line of our package.
    assert report["calls_into_ours"] == []
    assert report["generated"] == 6


def test_our_package_is_what_the_name_kernels_resolves_to(repo_root):
    """The shadowing is real (so the test above guards something): `kernels` is ours on this path."""
    code = "import importlib.util, sys; print(importlib.util.find_spec('kernels').origin)"
    done = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(repo_root / "kernels" / "__init__.py")
