"""docs/spec.md §3's attention mask as the additive float masks transformers' Gemma 4 takes in place of its own
builders ({layer type: [B, 1, S, S]}), the reference mask of the model oracles (tests/model/parity.py says why:
transformers 5.24 knows no packed documents, and its vision mask differs from §3 when an image run is longer than
the window), and the position ids of the same packed rows. Written from docs/spec.md, not from src/. Needs torch and
transformers: import it inside the caller's oracle guard (oracle_env.missing_oracle).
"""
import torch
from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

# Additive mask value of a disallowed pair: far below any score, yet finite so that a padding row (all pairs
# disallowed) stays finite (finfo.min + a negative score overflows to -inf, and softmax of all -inf is NaN).
MASKED = -1e30


def spec_allowed(doc, window, group=None):
    """docs/spec.md §3 for one row: [S, S] bool, query on dim 0. doc [S] (0: padding), window 0: none, group [S]
    (transformers' block sequence ids: an image's tokens share one, -1 elsewhere) or None: no bidirectional groups."""
    idx = torch.arange(doc.shape[0])
    q, k = idx[:, None], idx[None, :]
    valid = (doc[:, None] > 0) & (doc[None, :] > 0) & (doc[:, None] == doc[None, :])
    ordered = k <= q
    in_window = (q - k < window) if window else torch.ones_like(ordered)
    if group is None:
        return valid & ordered & in_window
    grouped = (group[:, None] >= 0) & (group[:, None] == group[None, :])
    return valid & ((ordered & in_window) | grouped)


def document_positions(doc):
    """position ids [B, S] of packed rows doc [B, S]: each run of one document id (padding's too) counts from 0."""
    pos = torch.zeros(doc.shape, dtype=torch.int64)
    for r in range(doc.shape[0]):
        p = 0
        for s in range(doc.shape[1]):
            if s > 0 and doc[r, s] != doc[r, s - 1]:
                p = 0
            pos[r, s] = p
            p += 1
    return pos


def spec_masks(cfg, doc, mm):
    """The masks of a text config's layer types for doc [B, S] and mm [B, S] (1: an image token): the attention_mask
    dict of a Gemma 4 forward, float64."""
    vision = cfg.use_bidirectional_attention == "vision"
    group = get_block_sequence_ids_for_mask(mm, device="cpu")
    out = {}
    for layer_type, window, groups in (("sliding_attention", cfg.sliding_window, vision),
                                       ("full_attention", 0, False)):  # 5.24: no groups on full layers
        allowed = torch.stack([spec_allowed(doc[r], window, group[r] if groups else None)
                               for r in range(doc.shape[0])])
        mask = torch.zeros(allowed.shape, dtype=torch.float64)
        mask[~allowed] = MASKED
        out[layer_type] = mask[:, None]
    return out
