"""What every vision-language model here shares: its decoder's config, the image rows merged
into the step's embeddings, and the split of checkpoint tensors between tower and decoder.

A VLM class is its decoder's ``*ForCausalLM`` (so the native decode stack, LoRA, tensor
parallelism and the loaders see the usual ``model`` / ``lm_head``) plus a vision tower and
projector. The towers are transformers' own modules, built from the checkpoint's
``vision_config`` and run in the model's dtype: they run once per image, at the EXTEND that
first reaches the image's placeholder tokens (srt/multimodal/req_images.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from srt.layers.linear import Linear
from srt.models.vision_layers import use_fast_tower_layers
from srt.multimodal.req_images import ImageRun, ImageSpan
from srt.utils.errors import WeightLoadError


def decoder_config(config: Any) -> Any:
    """A copy of the VLM config's ``text_config`` with what the decoder needs from the top level
    (whether the LM head is tied to the embedding)."""
    text = copy.deepcopy(config.get_text_config())
    tie = getattr(config, "tie_word_embeddings", None)
    if tie is not None:
        text.tie_word_embeddings = bool(tie)
    return text


def use_srt_linears(tower: nn.Module, dtype: torch.dtype, linear_backend: Any) -> nn.Module:
    """``tower`` with each of its ``nn.Linear`` layers replaced by srt's `Linear` on the model's
    linear backend (the packed native kernels on CPU once the weights are loaded; same parameter
    names, so the checkpoint loads as it is). They are ``replicated``: under tensor parallelism
    every rank runs the whole tower."""
    for module in list(tower.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                new = Linear(
                    child.in_features, child.out_features, child.bias is not None, dtype, linear_backend
                )
                new.replicated = True
                setattr(module, name, new)
    return tower


def srt_tower(tower: nn.Module, dtype: torch.dtype, linear_backend: Any) -> nn.Module:
    """A vision tower as srt runs it: its linear layers on the model's backend for many rows
    (`use_srt_linears`, ``LinearBackend.for_many_rows``: a tower sees every patch of an image at
    once), its patch convolutions and quick-GELU activations replaced
    (srt/models/vision_layers.py), in eval mode."""
    backend = linear_backend.for_many_rows(dtype) if linear_backend is not None else None
    return use_fast_tower_layers(use_srt_linears(tower, dtype, backend)).eval()


def tower_level_names(tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Checkpoint names of a CLIP / SigLIP ``vision_tower`` as the module was built: the Hub's
    checkpoints name its modules under ``vision_model.``, transformers 5 writes (and builds) some
    towers without that level; either is taken into the module's ``state`` names."""
    level = "vision_tower.vision_model."
    nested = any(k.startswith(level) for k in state)
    fixed = {}
    for name, t in tensors.items():
        if nested and name.startswith("vision_tower.") and not name.startswith(level):
            name = level + name[len("vision_tower.") :]
        elif not nested and name.startswith(level):
            name = "vision_tower." + name[len(level) :]
        fixed[name] = t
    return fixed


def merge_image_rows(
    hidden: torch.Tensor,
    spans: Sequence[ImageSpan],
    encode: Callable[[list[ImageRun]], Sequence[torch.Tensor]],
) -> torch.Tensor:
    """``hidden`` (the step's token embeddings) with each span's placeholder rows replaced by its
    image's embedding rows. Images without an embedding yet are encoded together (one
    ``encode`` call for the step); an image whose last row this step consumes lets it go."""
    todo: list[ImageRun] = []
    for s in spans:
        if s.image.embedding is None and all(s.image is not t for t in todo):
            todo.append(s.image)
    if todo:
        for image, rows in zip(todo, encode(todo)):
            if rows.shape[0] != image.length:
                raise RuntimeError(
                    f"the vision tower made {rows.shape[0]} rows of an image with {image.length} placeholders"
                )
            image.embedding = rows.to(hidden.dtype)
    for s in spans:
        hidden[s.row : s.row + s.n] = s.image.embedding[s.src : s.src + s.n]
    for s in spans:
        if s.src + s.n == s.image.length:
            s.image.embedding = None
    return hidden


class VisionLanguageMixin:
    """The image side of a VLM class, mixed in before its decoder's ``*ForCausalLM``:
    ``vision_attrs`` names the attributes that hold it (tower, projector ...; the checkpoint
    names them the same, bare or under ``model.``), ``encode_images`` turns images into
    embedding rows, ``rope_positions`` picks the decoder's positions for the step."""

    vision_attrs: tuple[str, ...] = ()
    # checkpoint prefixes of the decoder -> srt's (transformers 5's layout, the Hub's LLaVA layout)
    decoder_renames: tuple[tuple[str, str], ...] = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )

    def encode_images(self, images: list[ImageRun]) -> Sequence[torch.Tensor]:
        """Each image's embedding rows ``[length, hidden]``."""
        raise NotImplementedError

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings, as the decoder would make them (image rows overwrite
        theirs)."""
        return self.model.embed_tokens(input_ids)

    def vision_device(self) -> torch.device:
        """Where the tower runs (its own weights': the decoder's embedding may be released once
        packed, srt/model_loader/loader.py)."""
        return next(getattr(self, self.vision_attrs[0]).parameters()).device

    def rope_positions(self, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        return positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        embeds = None
        if forward_batch.image_spans:
            tokens = self.embed_text(input_ids)
            embeds = merge_image_rows(tokens, forward_batch.image_spans, self.encode_images)
        positions = self.rope_positions(positions, forward_batch)
        keep_rows = self.logits_processor.rows_read(forward_batch)
        hidden_states = self.model(
            input_ids, positions, forward_batch, input_embeds=embeds, keep_rows=keep_rows
        )
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def decoder_name(self, name: str) -> str | None:
        """A checkpoint (or adapter) name of the decoder as srt names it; None for one of the
        image side (``vision_attrs``, bare or under ``model.``)."""
        if name.removeprefix("model.").split(".", 1)[0] in self.vision_attrs:
            return None
        for old, new in self.decoder_renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The decoder's tensors through its own loader (renamed), the image side's here."""
        vision: dict[str, torch.Tensor] = {}

        def decoder() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                renamed = self.decoder_name(name)
                if renamed is None:
                    vision[name.removeprefix("model.")] = tensor
                    continue
                yield renamed, tensor

        super().load_weights(decoder())
        self._load_vision(vision)

    def missing_weights(self, params: dict[str, Any], loaded: dict) -> list[str]:
        missing = super().missing_weights(params, loaded)
        return [n for n in missing if n.split(".", 1)[0] not in self.vision_attrs]

    def _load_vision(self, tensors: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in self.state_dict().items() if k.split(".", 1)[0] in self.vision_attrs}
        extra = sorted(set(tensors) - set(state))
        missing = sorted(k for k in set(state) - set(tensors) if not k.endswith(_DERIVED))
        if extra or missing:
            raise WeightLoadError(
                f"{type(self).__name__}: the checkpoint's image-side tensors do not match the model "
                f"(no place for {extra[:6]}, none for {missing[:6]})"
            )
        with torch.no_grad():
            for k, v in tensors.items():
                if state[k].shape != v.shape:
                    raise WeightLoadError(f"{k} has shape {tuple(v.shape)}, {tuple(state[k].shape)} expected")
                state[k].copy_(v.to(state[k].dtype))


# buffers a tower computes itself (rotary inverse frequencies, position ids)
_DERIVED = ("inv_freq", "position_ids")
