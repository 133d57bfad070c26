#!/usr/bin/env python3
"""Image files become the patches transformers' Gemma 4 image processor makes of them (src/model/image_processor.h).

Generated here with Pillow: PNGs (RGB, RGBA with transparent pixels, grey with alpha, grey, 1-bit grey, palette,
palette with a transparent index, 16-bit RGB, 16-bit grey with and without a tRNS key, interlaced, one with an EXIF
orientation in its eXIf chunk) and JPEGs (colour, 4:2:0 and 4:4:4, grey, four stored sideways with an EXIF
orientation) of odd sizes, shrunk and enlarged by the resize, one already at its target size, one thin enough for the
processor's one-square fallback. For each,
tests/model/image_case (ringflex's decoder and preprocessing) against Pillow's decode, turned upright as transformers'
load_image turns a file (ImageOps.exif_transpose), and transformers 5.24's Gemma4ImageProcessorPil (the processor
transformers picks without torchvision, and what Gemma4ImageProcessor's PIL path computes):
  - the decoded RGB pixels: equal to transformers' convert_to_rgb of Pillow's image (both decode with libpng /
    libjpeg-turbo; transparency is composited onto white with Pillow's integer arithmetic in both; a
    JPEG may differ by a few units where the two libjpeg-turbo builds' IDCT or upsampling differ, so JPEG pixels
    are bounded, at most 2 of 255 per value and 0.5 on average, and measured);
  - the preprocessed pixel values, positions and soft-token counts: equal, bit for bit, when ringflex is given
    Pillow's decoded pixels (the resize is Pillow's fixed-point algorithm, the rescale the same double product),
    and within the JPEG bound above when each decodes on its own;
and every bad image (missing, empty, not an image, truncated PNG, truncated JPEG, zero-sized) fails with one line
naming the file. Exit 77 (CTest's skip) when transformers, Pillow or safetensors is missing.
"""
import io
import os
import subprocess
import sys
import tempfile
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import numpy as np
    from PIL import Image, ImageOps
    from safetensors.numpy import load_file
    from transformers.image_transforms import convert_to_rgb
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

PATCH, KERNEL, SOFT = 8, 3, 70           # small patches: max_patches 630 of 8 x 8, images up to ~200 x 200
JPEG_MAX_DIFF, JPEG_MEAN_DIFF = 2, 0.5   # in 8-bit units, see the docstring


def smooth(w, h, seed):
    """A smooth colour image with some texture (a resize of noise alone tests little)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(x / (3 + c) + y / (5 + c)) for c in range(3)], axis=-1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def make_images(d):
    files = {}

    def save(name, img, **kw):
        path = os.path.join(d, name)
        img.save(path, **kw)
        files[name] = path

    save("rgb_37x53.png", Image.fromarray(smooth(37, 53, 1)))
    rgba = np.concatenate([smooth(300, 17, 2), np.random.default_rng(3).integers(0, 256, (17, 300, 1), np.uint8)], -1)
    rgba[5, :40, 3] = 0  # fully transparent: white after transformers' compositing
    save("rgba_300x17.png", Image.fromarray(rgba, "RGBA"))
    grey_alpha = np.stack([smooth(26, 30, 14)[..., 0],
                           np.random.default_rng(15).integers(0, 256, (30, 26), np.uint8)], -1)
    save("grey_alpha_26x30.png", Image.fromarray(grey_alpha, "LA"))
    pal = Image.fromarray(smooth(40, 22, 16)).quantize(9)
    save("palette_trns_40x22.png", pal, transparency=3)  # palette index 3 transparent (a tRNS chunk)
    save("grey_64x64.png", Image.fromarray(smooth(64, 64, 4)[..., 0]))
    save("bits_19x23.png", Image.fromarray(smooth(19, 23, 5)[..., 0] > 128))
    save("palette_23x91.png", Image.fromarray(smooth(23, 91, 6)).quantize(17))
    wide = smooth(48, 40, 7).astype(np.uint16) * 257 + 77  # 16-bit RGB, low bytes not zero
    save("rgb16_48x40.png", Image.frombytes("RGB", (48, 40), wide.astype(">u2").tobytes(), "raw", "RGB;16B"))
    # 16-bit grey: Pillow's mode I;16, whose RGB clamps each value to 255 (not its high byte, as the other 16-bit
    # layouts); values below, at and far above 255, and a tRNS grey key, composited onto white.
    grey16 = (smooth(29, 17, 17)[..., 0].astype(np.uint16) * 3).astype(np.uint16)
    grey16[0, :8] = [0, 3, 254, 255, 256, 1000, 32768, 65535]
    save("grey16_29x17.png", Image.fromarray(grey16))
    save("grey16_trns_29x17.png", Image.fromarray(grey16), transparency=int(grey16[3, 3]))
    save("interlaced_41x29.png", Image.fromarray(smooth(41, 29, 8)), interlace=1)
    save("at_target_48x72.png", Image.fromarray(smooth(48, 72, 9)))  # 48 = 2 x 24, 72 = 3 x 24: no resize
    save("thin_500x3.png", Image.fromarray(smooth(500, 3, 10)))      # the processor's one-square fallback
    save("photo_120x80.jpg", Image.fromarray(smooth(120, 80, 11)), quality=90)
    save("photo444_33x47.jpg", Image.fromarray(smooth(33, 47, 12)), quality=95, subsampling=0)
    save("grey_70x31.jpg", Image.fromarray(smooth(70, 31, 13)[..., 0]), quality=85)
    # Stored sideways with an EXIF orientation: transformers' load_image turns every file upright (exif_transpose).
    for orientation, (w, h) in ((6, (45, 28)), (8, (21, 50)), (3, (30, 30)), (5, (52, 17))):
        exif = Image.Exif()
        exif[0x0112] = orientation
        save(f"exif{orientation}_{w}x{h}.jpg", Image.fromarray(smooth(w, h, 20 + orientation)), quality=92,
             exif=exif.tobytes())
    exif = Image.Exif()
    exif[0x0112] = 7
    save("exif7_33x19.png", Image.fromarray(smooth(33, 19, 30)), exif=exif.tobytes())  # a PNG's eXIf chunk
    return files


def upright(path):
    """The image transformers reads from a file: Pillow's, turned upright by its EXIF orientation (load_image)."""
    return ImageOps.exif_transpose(Image.open(path))


def rgb_as_transformers(img):
    """The RGB pixels transformers' processor starts from: convert_to_rgb composites transparency onto white."""
    return convert_to_rgb(img, return_numpy=True)


def bad_images(d, good_png, good_jpg):
    bad = {}

    def write(name, data):
        path = os.path.join(d, name)
        with open(path, "wb") as f:
            f.write(data)
        bad[name] = path

    png, jpg = open(good_png, "rb").read(), open(good_jpg, "rb").read()
    write("empty.png", b"")
    write("text.png", b"this is not an image\n")
    write("truncated.png", png[: len(png) // 2])
    write("truncated.jpg", jpg[: len(jpg) // 2])
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG")
    z = bytearray(buf.getvalue())
    z[16:20] = (0).to_bytes(4, "big")  # IHDR width 0, with the chunk's CRC made right again
    z[29:33] = zlib.crc32(bytes(z[12:29])).to_bytes(4, "big")
    write("zero_width.png", bytes(z))
    bad["missing.png"] = os.path.join(d, "missing.png")
    return bad


def run_case(image_case, out, paths):
    proc = subprocess.run([image_case, str(PATCH), str(KERNEL), str(SOFT), out, *paths], capture_output=True,
                          text=True)
    return proc, (load_file(out) if proc.returncode == 0 else None)


def main():
    if len(sys.argv) != 2:
        print("usage: image_parity.py PATH/TO/image_case")
        return 2
    image_case = sys.argv[1]
    processor = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=KERNEL, max_soft_tokens=SOFT)
    failures = []
    with tempfile.TemporaryDirectory() as d:
        files = make_images(d)
        names = sorted(files)
        proc, got = run_case(image_case, os.path.join(d, "out.safetensors"), [files[n] for n in names])
        if got is None:
            print(f"FAIL image_case: {proc.stderr.strip()}")
            return 1
        # Pillow's decode, written back as lossless RGB PNGs: ringflex's preprocessing on exactly Pillow's pixels.
        pil_rgb = {n: rgb_as_transformers(upright(files[n])) for n in names}
        same_in = []
        for n in names:
            path = os.path.join(d, "pil_" + n + ".png")
            Image.fromarray(pil_rgb[n]).save(path)
            same_in.append(path)
        proc, exact = run_case(image_case, os.path.join(d, "exact.safetensors"), same_in)
        if exact is None:
            print(f"FAIL image_case on Pillow's pixels: {proc.stderr.strip()}")
            return 1
        worst_jpeg = (0, 0.0)
        for i, n in enumerate(names):
            ref = processor(images=[upright(files[n])], return_tensors="np")
            ref_px, ref_pos = ref["pixel_values"][0], ref["image_position_ids"][0]
            ref_soft = int(ref["num_soft_tokens_per_image"][0])
            at = f"image.{i}."
            diff = np.abs(got[at + "rgb"].astype(int) - pil_rgb[n].astype(int))
            if n.endswith(".jpg"):
                worst_jpeg = (max(worst_jpeg[0], int(diff.max())), max(worst_jpeg[1], float(diff.mean())))
                if diff.max() > JPEG_MAX_DIFF or diff.mean() > JPEG_MEAN_DIFF:
                    failures.append(f"{n}: decoded pixels differ by up to {diff.max()} (mean {diff.mean():.3f})")
            elif diff.max() != 0:
                failures.append(f"{n}: decoded pixels differ from Pillow's by up to {diff.max()}")
            for what, mine in (("from Pillow's pixels", exact), ("from the file", got)):
                if not np.array_equal(mine[at + "position_ids"], ref_pos) or int(mine[at + "soft_tokens"][0]) != ref_soft:
                    failures.append(f"{n} {what}: positions or soft-token count differ ({int(mine[at + 'soft_tokens'][0])}"
                                    f" vs {ref_soft})")
                    continue
                px = mine[at + "pixel_values"]
                if px.shape != ref_px.shape:
                    failures.append(f"{n} {what}: pixel_values {px.shape}, processor {ref_px.shape}")
                    continue
                delta = np.abs(px.astype(np.float64) - ref_px.astype(np.float64)) * 255
                bound = 0 if (what == "from Pillow's pixels" or not n.endswith(".jpg")) else JPEG_MAX_DIFF + 1e-3
                if delta.max() > bound:
                    failures.append(f"{n} {what}: pixel values differ by up to {delta.max():.3f} / 255")
        for name, path in bad_images(d, files["rgb_37x53.png"], files["photo_120x80.jpg"]).items():
            proc, _ = run_case(image_case, os.path.join(d, "bad.safetensors"), [files["rgb_37x53.png"], path])
            lines = proc.stderr.strip().splitlines()
            if proc.returncode != 1 or len(lines) != 1 or not lines[0].startswith(path + ": "):
                failures.append(f"bad image {name}: rc {proc.returncode}, stderr {proc.stderr.strip()!r}")
            else:
                print(f"ok   bad {name:16s}: {lines[0][len(path) + 2:]}")
    if failures:
        for f in failures:
            print("FAIL " + f)
        return 1
    print(f"ok   {len(names)} images: decoded and preprocessed as transformers' processor (JPEG decode within "
          f"{worst_jpeg[0]} / 255, mean {worst_jpeg[1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
