"""Loaded by vLLM into its worker (`--worker-extension-cls eagle3ops.serving.drafter_swap.DrafterSwap`): a drafter's
weights put into the running engine in place of the ones it started with, the target untouched.

Called through `collective_rpc` (the server's /collective_rpc, VLLM_SERVER_DEV_MODE=1; serving/session.py). The
load is vLLM's own in-place reload (`vllm.model_executor.model_loader.reload`): the draft model's parameters back in
checkpoint layout, the drafter's `load_weights` (d2t, the layer names of the speculators layout), then the kernels'
own processing again (on a CPU the linear layers repack their weights). The drafter must have the engine's shape;
serving/session.py keys engines by the drafter's config, so another shape never reaches this. Runs in vLLM's
process: it imports vLLM and safetensors, nothing of eagle3ops."""
from __future__ import annotations

import hashlib
from pathlib import Path


class DrafterSwap:
    """Mixed into vLLM's worker class; `self` is the worker (get_draft_model, speculative_config)."""

    def eagle3ops_load_drafter(self, export_dir: str) -> str:
        """Load the speculators export at `export_dir` into the draft model; returns the sha256 of its weights
        file, which the caller compares with its own."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.get_draft_model()
        if model is None:
            raise RuntimeError("this engine serves no drafter: it was started without --speculative-config")
        path = Path(export_dir) / "model.safetensors"
        weights = load_file(str(path))
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights.items()))
        finalize_layerwise_reload(model, self.speculative_config.draft_model_config)
        return hashlib.sha256(path.read_bytes()).hexdigest()
