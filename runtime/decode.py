"""One decode step of the whole model over a StaticTaleCache, captured as a CUDA graph (gpt-fast style).

The step has fixed shapes: input ids [B, 1] and positions [B, 1] live in static buffers, every cache
region is read over its whole capacity with lengths on the device, and the new token goes into the
residual at a device-held slot. What changes shape or runs only every few steps (the flush of the
residual, demotions) stays outside the graph: after each replay, `StaticTaleCache.advance()` counts
the token on the host and runs that fixed-size work when the schedule says so.

    decoder = CudaGraphDecoder(model, cache)     # after the prefill filled `cache`
    logits = decoder(ids, position_ids)          # [B, V]; valid until the next call
"""

from __future__ import annotations

import warnings

import torch

from .static_cache import StaticTaleCache


class CudaGraphDecoder:
    def __init__(self, model, cache: StaticTaleCache):
        if not isinstance(cache, StaticTaleCache) or cache.book is None:
            raise ValueError("CudaGraphDecoder needs a StaticTaleCache filled by a prefill")
        self.model, self.cache = model, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warm = False  # one plain step ran eagerly (on a side stream) before the capture
        self.ids = self.pos = self.logits = None
        self.error: str | None = None  # why capturing failed; the steps then stay eager

    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids, position_ids=position_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1]

    def _plain(self) -> bool:
        b = self.cache.book
        return b.sink_len == b.sink_cap and b.res_len < b.residual_cap

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """ids, position_ids: [B, 1] long on the model's device -> logits [B, V]."""
        plain = self._plain()
        if not plain or not self.warm or self.error:  # eager; the first plain step warms up on a side stream
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                logits = self._forward(ids, position_ids)
            torch.cuda.current_stream().wait_stream(s)
            self.warm = self.warm or plain
            return logits
        if self.graph is None:
            self.ids, self.pos = ids.clone(), position_ids.clone()
            self.graph = torch.cuda.CUDAGraph()
            self.cache.capturing = True
            try:
                with torch.cuda.graph(self.graph):
                    self.logits = self._forward(self.ids, self.pos)
            except Exception as e:  # noqa: BLE001  (nothing of the step ran: the cache is unchanged)
                self.graph, self.error = None, f"{type(e).__name__}: {e}"
                warnings.warn(f"CUDA graph capture failed, decoding eagerly: {self.error}", stacklevel=2)
                return self(ids, position_ids)
            finally:
                self.cache.capturing = False
        self.ids.copy_(ids)
        self.pos.copy_(position_ids)
        self.graph.replay()
        self.cache.advance()
        return self.logits
