#!/usr/bin/env python3
"""Cross-checks ringflex's safetensors I/O against Python's `safetensors` package, the format's reference.

Python writes one tensor per dtype from a formula and `safetensors_fixture check` must read it back exactly;
then `safetensors_fixture write` writes the same tensors and Python must load them exactly. The formula is
mirrored in safetensors_fixture.cpp. When `safetensors` is not
installed: exits 77 (CTest's skip), or fails under CI (tests/common/oracle_env.py).
"""
import os
import subprocess
import sys
import tempfile

SHAPE = (2, 3, 5)
ELEMENTS = 2 * 3 * 5

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
except ImportError as e:
    missing_oracle(e)


def float_value(i):
    return (i % 13) * 0.5 - 3.0


def signed_value(i):
    return (i * 7) % 100 - 50


def unsigned_value(i):
    return (i * 7) % 200


def bool_value(i):
    return i % 3 == 0


# safetensors dtype -> (numpy dtype, formula)
NUMPY = {
    "BOOL": (np.bool_, bool_value),
    "U8": (np.uint8, unsigned_value),
    "I8": (np.int8, signed_value),
    "I16": (np.int16, signed_value),
    "U16": (np.uint16, unsigned_value),
    "F16": (np.float16, float_value),
    "I32": (np.int32, signed_value),
    "U32": (np.uint32, unsigned_value),
    "F32": (np.float32, float_value),
    "I64": (np.int64, signed_value),
    "U64": (np.uint64, unsigned_value),
    "F64": (np.float64, float_value),
}


def expected():
    return {
        f"t_{name.lower()}": np.array([f(i) for i in range(ELEMENTS)], dtype=dtype).reshape(SHAPE)
        for name, (dtype, f) in NUMPY.items()
    }


def bf16_expected():
    """The BF16 tensor through torch, or None when torch is not installed (NumPy has no bfloat16)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.tensor([float_value(i) for i in range(ELEMENTS)], dtype=torch.bfloat16).reshape(SHAPE)


def main():
    fixture = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        theirs = os.path.join(tmp, "python.safetensors")
        ours = os.path.join(tmp, "ringflex.safetensors")

        bf16 = bf16_expected()
        if bf16 is None:
            save_file(expected(), theirs, metadata={"origin": "python"})
        else:
            import torch
            from safetensors.torch import save_file as torch_save

            tensors = {k: torch.from_numpy(v) for k, v in expected().items()}
            tensors["t_bf16"] = bf16
            torch_save(tensors, theirs, metadata={"origin": "python"})
        subprocess.run([fixture, "check", theirs], check=True)

        subprocess.run([fixture, "write", ours], check=True)
        with safe_open(ours, framework="numpy") as f:
            assert f.metadata() == {"origin": "ringflex"}, f.metadata()
        if bf16 is not None:
            from safetensors.torch import load_file as torch_load

            loaded_bf16 = torch_load(ours)["t_bf16"]
            assert loaded_bf16.dtype == bf16.dtype and torch.equal(loaded_bf16, bf16), "t_bf16 differs"
        # NumPy has no bfloat16, so the other tensors are read one by one, leaving t_bf16 to torch above.
        with safe_open(ours, framework="numpy") as f:
            loaded = {k: f.get_tensor(k) for k in f.keys() if k != "t_bf16"}
        want = expected()
        assert set(loaded) == set(want), sorted(loaded)
        for name, value in want.items():
            got = loaded[name]
            assert got.dtype == value.dtype and got.shape == value.shape, (name, got.dtype, got.shape)
            assert np.array_equal(got, value), name
    print("ok: ringflex and Python safetensors read each other's files exactly")


if __name__ == "__main__":
    main()
