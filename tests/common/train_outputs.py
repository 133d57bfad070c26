"""What the multi-rank shell tests (tests/trainer/*_mpirun.sh) read back from `ringflex train`'s outputs: metrics
lines, safetensors files and a sharded run's moment files, with the Python standard library alone (those tests
need none of the oracle packages). On PYTHONPATH through tests/common/mpirun_lib.sh.
"""
import array
import json
import os
import struct

EXACT_KEYS = ("loss", "grad_norm", "val_loss")


def metrics(path):
    """The lines of a --metrics file, one dict a step."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def expect_same_steps(a, b, steps, keys=EXACT_KEYS, what=""):
    """Two runs' metrics: `steps` lines each, every step's `keys` the same bits (a key neither line has is equal)."""
    assert len(a) == len(b) == steps, (len(a), len(b))
    for x, y in zip(a, b):
        for key in keys:
            assert x.get(key) == y.get(key), f"{what}step {x['step']}: {key} {x.get(key)!r} vs {y.get(key)!r}"


def safetensors_header(path):
    """The JSON header of a safetensors file (without __metadata__) and the file's data bytes after it."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def tensors(path, dtype=None):
    """name -> the float32 values of each tensor of a safetensors file (of dtype `dtype` only, e.g. "F32", if given)."""
    header, data = safetensors_header(path)
    return {name: array.array("f", data[t["data_offsets"][0]:t["data_offsets"][1]])
            for name, t in header.items() if dtype is None or t["dtype"] == dtype}


def max_abs_difference(path_a, path_b):
    """The largest |a - b| over the float32 tensors of two safetensors files, which must name the same tensors."""
    a, b = tensors(path_a, "F32"), tensors(path_b, "F32")
    assert a.keys() == b.keys() and a, sorted(set(a) ^ set(b))
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name]))


def expect_sharded_moments(whole_ck, sharded_ck):
    """A sharded run's AdamW moments (optimizer.json and one file a rank: flat ranges of the trainable layout) equal,
    value for value, shard none's optimizer.safetensors (one tensor a parameter and moment). Returns optimizer.json."""
    whole = tensors(os.path.join(whole_ck, "optimizer.safetensors"))
    with open(os.path.join(sharded_ck, "optimizer.json")) as f:
        layout = json.load(f)
    assert len(layout["files"]) == layout["ranks"], layout["files"]
    flat = {"exp_avg": array.array("f"), "exp_avg_sq": array.array("f")}
    for f in layout["files"]:
        part = tensors(os.path.join(sharded_ck, f["file"]))
        for k in flat:
            assert len(part[k]) == f["end"] - f["begin"], (f, k)
            flat[k].extend(part[k])
    for p in layout["parameters"]:
        n = 1
        for d in p["shape"]:
            n *= d
        for k in flat:
            assert flat[k][p["offset"]:p["offset"] + n] == whole[k + "." + p["name"]], f"{k} of {p['name']} differs"
    assert 2 * len(layout["parameters"]) == len(whole), "the sharded files miss parameters"
    return layout
