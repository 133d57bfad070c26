"""A float64 reference of a Gemma 4 MoE model's routing, and the router's scores and choices on any run of it.

transformers 5.24 takes Gemma4RMSNorm and the router's softmax in float32 whatever the model's dtype, so its
float64 model still rounds every normed hidden state and router probability to float32: near a router tie such a
reference can pick either side as float32 does. Here both run in the input's dtype (the same operations as
transformers' in float32, where its casts do nothing; RoPE's float32 angles stay, ringflex computes them the same
way). Used by tests/model/router_near_tie.py and bench/model/moe_token_parity.py.
"""
import torch
from transformers.models.gemma4 import modeling_gemma4


def norm_in_input_dtype(self, hidden):
    """Gemma4RMSNorm.forward without its float32 cast."""
    out = self._norm(hidden)
    return out * self.weight if self.with_scale else out


def use_float64_norms():
    modeling_gemma4.Gemma4RMSNorm.forward = norm_in_input_dtype


def routed_forward(router, forced=None):
    """Gemma4TextRouter.forward with the softmax and top-k in the input's dtype; records the scores before the softmax
    (router.seen_scores [T, E], float64) and its own top-k of them (router.seen_experts [T, K]); with `forced`
    ([T, K] expert indices) the experts run on those choices instead, weighted by its own probabilities
    renormalised as the router does (so a later layer's scores are those of the forced history)."""
    def forward(hidden):
        h = router.norm(hidden) * router.scale * router.scalar_root_size
        scores = router.proj(h)
        router.seen_scores = scores.detach().double()
        probs = torch.softmax(scores, dim=-1)
        top_w, top_i = torch.topk(probs, k=router.config.top_k_experts, dim=-1)
        router.seen_experts = top_i.detach().clone().long()
        if forced is not None:
            top_i = forced.to(top_i.device)
            top_w = probs.gather(-1, top_i)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w * router.per_expert_scale[top_i], top_i
    return forward


def moe_layers(model):
    return [i for i, layer in enumerate(model.model.layers) if getattr(layer, "enable_moe_block", False)]


def run_routed(model, ids, labels, forced=None):
    """Per-token loss [S] (float64), the router's scores {layer: [S, E]} and own top-k {layer: [S, K]} of row 0;
    with `forced` ({layer: [S, K]}) the experts run on those choices: then each layer's scores and top-k are what
    this model computes after the forced history (a choice flipped at one layer moves that token's later scores by
    O(1), so comparing another run's scores and choices is only meaningful on the same history)."""
    layers = moe_layers(model)
    if model.dtype == torch.float64:
        model.config._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)
    for i in layers:
        router = model.model.layers[i].router
        router.forward = routed_forward(router, None if forced is None else forced[i])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, labels[0], reduction="none").double()
    routers = {i: model.model.layers[i].router for i in layers}
    return loss, {i: r.seen_scores for i, r in routers.items()}, {i: r.seen_experts for i, r in routers.items()}


def kth_gap(scores, K):
    """Per token, the k-th minus the (k+1)-th highest score [T]: how far the top-k set is from changing."""
    top = torch.topk(scores, K + 1, dim=-1).values
    return top[:, K - 1] - top[:, K]


def same_set(a, b):
    """Per token, whether two [T, K] choices hold the same experts (in any order)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)
