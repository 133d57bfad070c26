#!/usr/bin/env python3
"""`ringflex generate` on an image prompt against transformers 5.24's own generate with pixel_values, in float32.

The checkpoint is tests/trainer/chat_train.py's tiny random Gemma4ForConditionalGeneration (a one-layer vision tower,
vision-bidirectional attention; its sliding window raised to 64, WINDOW says why), read in float32. The prompt:
<bos>, text, <|image>, the image's 63 soft-token slots, <image|>, text; 160 tokens, so the prompt crosses the sliding
window, the window's edge passes through the image run for the text after it, and the decoded tokens see the image
through the full layer only. The image is a random picture through
transformers' Gemma4ImageProcessorPil, its pixel_values and image_position_ids given to both
sides: ringflex's batch file (`--in`, through the checkpoint's tower) and transformers'
generate(input_ids, pixel_values=..., image_position_ids=..., mm_token_type_ids=..., use_cache=True,
do_sample=False), whose first step runs the tower and the prompt with the bidirectional image mask
(Gemma4ForConditionalGeneration.prepare_inputs_for_generation passes mm_token_type_ids and the pixels to the
prefill only) and whose later steps decode on its cache.
Checked at every launcher (`--ranks 1 2 3 -- MPIEXEC...`): 64 greedy tokens equal to transformers' and each step's
logits within generate_parity.py's tolerance (parity.REL_TOL, 1e-4 relative: both sides are float32 and ringflex's
decode only reorders float32 sums; its reason is written in generate_parity.py), with generate_parity.compare's rule
for a tie under rounding. Exit 77 (CTest's skip) without torch, transformers or safetensors.
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "trainer"))
from launchers import describe, launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from PIL import Image
    from transformers import Gemma4ForConditionalGeneration
    from safetensors.torch import save_file
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    import generate_parity
    from chat_train import BOI, EOI, IMAGE, SOFT, VISION, checkpoint
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

NEW_TOKENS = generate_parity.NEW_TOKENS  # 64
BOS = 2  # the tiny chat tokenizer's <bos>
# The checkpoint's sliding window, raised from chat_train.py's 16 so that the image run (the processor's 70-token
# budget gives this picture 63 slots) is no longer than the window. Why: for an image run longer than the window,
# transformers 5.24's sliding mask (create_masks_for_vision_model: AND(window, OR(causal, the image's block))) lets an
# image token see its image's later tokens but not those W or more before it, where docs/spec.md §3, which ringflex
# computes, lets it see the whole image: generate then gives other logits by design (0.3 relative on this model with
# the window at 16), not by a fault of either cache. That case is compared against transformers' cache-free forward
# with §3's masks (generate_parity.py's image cases, tests/common/spec_mask.py).
WINDOW = 64
PROMPT = 160  # crosses the window twice; the 64 decoded tokens leave the image behind on the sliding layer


def prompt(gen):
    """The batch tensors of one image prompt (ids, token types, the processor's pixels and positions)."""
    rgb = torch.randint(0, 256, (27, 19, 3), generator=gen, dtype=torch.uint8).numpy()
    processor = Gemma4ImageProcessorPil(patch_size=VISION["patch_size"],
                                        pooling_kernel_size=VISION["pooling_kernel_size"], max_soft_tokens=SOFT)
    feats = processor([Image.fromarray(rgb)], return_tensors="pt")
    slots = int(feats["num_soft_tokens_per_image"][0])
    text = lambda n: torch.randint(3, BOI, (n,), generator=gen).tolist()  # noqa: E731  (ids below the image tokens)
    ids = [BOS] + text(9) + [BOI] + [IMAGE] * slots + [EOI] + text(PROMPT - 12 - slots)
    x = torch.tensor([ids])
    return x, (x == IMAGE).long(), feats["pixel_values"].float(), feats["image_position_ids"], slots


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: image_generate.py RINGFLEX [--ranks P... -- MPIEXEC...]")
    ringflex, runs = sys.argv[1], launchers(sys.argv[2:])
    failures = []
    with tempfile.TemporaryDirectory() as work:
        _, ckpt, _ = checkpoint(work)
        config_file = os.path.join(ckpt, "config.json")
        with open(config_file) as f:
            config = json.load(f)
        config["text_config"]["sliding_window"] = WINDOW
        with open(config_file, "w") as f:
            json.dump(config, f)
        model = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        gen = torch.Generator().manual_seed(11)
        x, mm, pixels, positions, slots = prompt(gen)
        assert slots <= WINDOW < x.shape[1], (slots, WINDOW, x.shape)
        # Greedy, no end tokens: both sides run all 64 steps (generate_parity.py's checkpoints do the same).
        with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
            f.write('{"do_sample": false}\n')
        batch = os.path.join(work, "image_prompt.safetensors")
        save_file({"input_ids": x.to(torch.int32), "mm_token_type_ids": mm.to(torch.int32),
                   "pixel_values": pixels.contiguous(), "image_position_ids": positions.to(torch.int32).contiguous()},
                  batch)
        with torch.no_grad():
            out = model.generate(input_ids=x, pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=mm,
                                 attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref_tokens = out.sequences[0, x.shape[1]:].tolist()
        ref_logits = torch.stack([z[0] for z in out.logits])
        worst = 0.0
        for launcher in runs:
            P = ranks_of(launcher)
            tag = f"image prompt P={P}"
            record, logits, error = generate_parity.run_generate(ringflex, launcher, ckpt, batch, work, f"image_{P}")
            if error:
                failures.append(f"{tag}: {error}")
                continue
            worst = max(worst, generate_parity.compare(tag, record["token_ids"], logits, ref_tokens, ref_logits,
                                                       failures))
        print(f"image prompt of {x.shape[1]} tokens ({slots} image slots, sliding window "
              f"{model.config.text_config.sliding_window}): {NEW_TOKENS} greedy tokens equal transformers' generate "
              f"with pixel_values, logits within {worst:.1e} (tolerance {generate_parity.REL_TOL}), at P = "
              f"{describe(runs)}")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
