"""vLLM's hidden-states connector, able to copy off an engine on the CPU too. Loaded inside the engine process
(`kv_connector_module_path`), beside the `extract_hidden_states` speculative method (serving/vllm.py, `capture`).

vLLM 0.32's ExampleHiddenStatesConnector writes each finished request's captured states as
`<shared_storage_path>/<request id>.safetensors` ({hidden_states [T, layers, H], token_ids [T]}). Its copy off the
device takes a CUDA stream, a CUDA event and pinned host memory; on vLLM's CPU build the capture itself works, but
that copy fails ("pin_memory=True requires a CUDA or other accelerator backend"). On a CPU the cache already is host
memory: this subclass slices it and hands the slice to the same writer threads. On a GPU it is vLLM's own path.
"""
from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CopiedAlready:
    """The CUDA event's part, for a copy that ran synchronously."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)[:, None]  # [blocks, 1]
        slots = (blocks * self._block_size + torch.arange(self._block_size)).flatten()  # [blocks * block_size]
        # a copy: the blocks go back to the engine as soon as get_finished reports the request
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # [T, layers, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock = self._lock_fds.pop(pending.req_id, None)
        if lock is None and self.use_lock:
            lock = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock, fcntl.LOCK_EX)
        done = _CopiedAlready()
        future = self._executor.submit(self._write_tensors, {"hidden_states": states,
                                                             "token_ids": pending.token_ids.clone()},
                                       done, pending.filename, lock)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda finished: self._on_write_done(pending.req_id, finished))
