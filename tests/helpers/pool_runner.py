"""A model run step by step over srt's real KV pools with the torch-native attention backend
(the reference for windows and caps), for the model tests."""

from __future__ import annotations

import torch

from srt.layers.attention.torch_native import TorchNativeAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class PoolRunner:
    """Runs a model step by step over real pools with the torch-native backend; request ``r``
    stores position ``p`` in KV slot ``1 + r * 256 + p``."""

    def __init__(self, model, cfg, max_reqs: int = 4, backend_cls=TorchNativeAttnBackend) -> None:
        self.model = model
        self.req_pool = ReqToTokenPool(max_reqs, 256, "cpu")
        self.kv_pool = MHATokenToKVPool(
            256 * max_reqs,
            1,
            torch.float32,
            cfg.num_key_value_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            cfg.num_hidden_layers,
            "cpu",
        )
        self.backend = backend_cls(None)
        self.rows = self.req_pool.alloc(max_reqs)
        for r, row in enumerate(self.rows):
            self.req_pool.write(row, 0, torch.arange(1 + r * 256, 1 + (r + 1) * 256))

    @torch.inference_mode()
    def step(self, mode: ForwardMode, seqs: list[tuple[int, list[int], int]], **kw):
        """``seqs``: (request, token ids, prefix length) each; returns the LogitsProcessorOutput."""
        fb = self.batch(mode, seqs, **kw)
        return self.model(fb.input_ids, fb.positions, fb)

    @torch.inference_mode()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final hidden states ``[len(ids), hidden]`` of a whole prompt (request 0)."""
        fb = self.batch(ForwardMode.EXTEND, [(0, ids, 0)])
        return self.model.model(fb.input_ids, fb.positions, fb)

    def batch(self, mode: ForwardMode, seqs: list[tuple[int, list[int], int]], **kw) -> ForwardBatch:
        """The step's ForwardBatch over the pools (``kw`` goes to ``ForwardBatch.build``)."""
        ids = [t for _, toks, _ in seqs for t in toks]
        slots = [1 + r * 256 + p + i for r, toks, p in seqs for i in range(len(toks))]
        fb = ForwardBatch.build(
            mode,
            ids,
            [self.rows[r] for r, _, _ in seqs],
            [p for _, _, p in seqs],
            [len(toks) for _, toks, _ in seqs],
            slots,
            **kw,
        )
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = self.req_pool, self.kv_pool, self.backend
        self.backend.init_forward_metadata(fb)
        return fb
