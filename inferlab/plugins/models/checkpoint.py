"""Reading a Hugging Face safetensors checkpoint for a model: which files hold its weights, each
tensor as a lazy slice (a rank reads only its shard from disk), and the checks that make a bad
checkpoint fail at load, naming the file and the tensor or field, instead of computing garbage.

- Weights must be floating point: float16, bfloat16, float32 or float64. float64 is cast to the
  model's dtype like the others (a cast that overflows shows up as an infinity, refused below);
  bool and integer tensors are refused, as are float8 ones (their scales are not read).
- Every value read must be finite after the cast to the model's dtype. The check runs where the
  weight goes (on the GPU there), one tensor at a time.
- With an index file (model.safetensors.index.json) exactly the files it lists are read; without
  one, every *.safetensors file. A tensor that two files both hold is an error naming both."""

import glob
import json
import logging
import math
import os
import struct
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

log = logging.getLogger("inferlab")

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# bytes per element of each safetensors dtype, for diagnosing a header (sub-byte types left out)
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}


class CheckpointError(ValueError):
    """The checkpoint's files or tensors do not match what the model needs."""


def weight_files(path: str) -> list[str]:
    """The safetensors files holding the checkpoint's weights, sorted."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        listed = _indexed_files(index)
        absent = [name for name in listed if not os.path.exists(os.path.join(path, name))]
        if absent:
            raise FileNotFoundError(f"weight files listed in {index!r} are missing: {absent}")
        files = [os.path.join(path, name) for name in listed]
        others = sorted(set(glob.glob(os.path.join(path, "*.safetensors"))) - set(files))
        if others:  # e.g. Mistral's consolidated.safetensors beside the HF shards
            log.info(
                "reading the weight files %s lists; ignoring %s", INDEX_FILE, [os.path.basename(f) for f in others]
            )
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weight files in {path!r}")
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"weight file {file!r} is not a file (a directory?); a safetensors file is expected")
    return files


def _indexed_files(index: str) -> list[str]:
    with open(index) as f:
        text = f.read()
    try:
        content = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"index file {index!r} is not valid JSON: {e}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"index file {index!r} has no 'weight_map' object (tensor name -> file name); got {type(weight_map).__name__}"
        )
    bad = {name: file for name, file in weight_map.items() if not isinstance(file, str) or os.sep in file}
    if bad:
        raise CheckpointError(
            f"index file {index!r}: 'weight_map' must map tensor names to file names in the directory; got {bad}"
        )
    return sorted(set(weight_map.values()))


class CheckedSlice:
    """One checkpoint tensor, read lazily: get_shape() and [index] as a safetensors slice, each read
    checked (a floating dtype, finite values) and cast to the model's dtype on its device."""

    def __init__(self, source, file: str, name: str, dtype: torch.dtype, device: torch.device):
        self.source, self.file, self.name, self.dtype, self.device = source, file, name, dtype, device

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        value = self.source[index]
        if value.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"weight file {self.file!r}: tensor {self.name!r} has dtype {str(value.dtype).replace('torch.', '')}; "
                f"weights must be one of {[str(d).replace('torch.', '') for d in FLOAT_DTYPES]}"
            )
        value = value.to(device=self.device, dtype=self.dtype)
        # A NaN or infinity makes the sum non-finite; one summing pass is far cheaper on CPU than
        # isfinite(value).all(), which builds a mask the size of the weight. Only a sum that is not finite is checked element by element, as
        # finite values may also overflow it.
        if not torch.isfinite(value.sum()):
            count = int((~torch.isfinite(value)).sum())
            if count:
                raise CheckpointError(
                    f"weight file {self.file!r}: tensor {self.name!r} has {count} NaN or infinite values "
                    f"(in {str(self.dtype).replace('torch.', '')}, the model's dtype)"
                )
        return value


def read_tensors(files: list[str], dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, str, CheckedSlice]]:
    """(file, tensor name, CheckedSlice) for every tensor of every file, a file at a time."""
    for file in files:
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except SafetensorError as e:
            raise CheckpointError(
                f"weight file {file!r} is not a readable safetensors file: {header_problem(file, e)}"
            ) from None
        except OSError as e:
            raise CheckpointError(f"weight file {file!r} cannot be read: {e}") from None
        with handle as f:
            for name in f.keys():
                yield file, name, CheckedSlice(f.get_slice(name), file, name, dtype, device)


def header_problem(file: str, error: Exception) -> str:
    """What is wrong with a safetensors file's header, naming the tensor and field where it can;
    safetensors' own message (error) otherwise. The format: an 8-byte little-endian length N, N
    bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then the data."""
    size = os.path.getsize(file)
    if size < 8:
        return f"the file has {size} bytes, fewer than the 8 of the header's length"
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            return f"the header's length says {length} bytes, but only {size - 8} follow it"
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"the header is not valid JSON: {e}"
    if not isinstance(header, dict):
        return f"the header is a JSON {type(header).__name__}, not an object of tensors"
    data_size, covered = size - 8 - length, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r}"
        if not isinstance(entry, dict):
            return f"{where}: its header entry is {entry!r}, not an object"
        absent = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
        if absent:
            return f"{where}: header entry lacks {absent}"
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            return f"{where}: dtype {dtype!r} is not a safetensors dtype this check knows ({sorted(DTYPE_SIZES)})"
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            return f"{where}: shape {shape!r} is not a list of sizes"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
            return f"{where}: data_offsets {offsets!r} is not [begin, end]"
        begin, end = offsets
        needed = math.prod(shape) * DTYPE_SIZES[dtype]
        if not 0 <= begin <= end <= data_size:
            return f"{where}: data_offsets {offsets} fall outside the file's {data_size} bytes of data"
        if end - begin != needed:
            return (
                f"{where}: data_offsets {offsets} span {end - begin} bytes, but shape {shape} of {dtype} needs {needed}"
            )
        covered += needed
    if covered != data_size:
        return f"the tensors' data_offsets cover {covered} bytes, but the file has {data_size} bytes of data (overlapping or stray bytes)"
    return str(error)
