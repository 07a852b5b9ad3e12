"""State trees <-> JSON, and the one walker of an encoded tree.

JSON keeps everything readable; a tensor becomes {"$tensor": i} (its bytes go to the data
files), a view of a disk table's rows {"$rows": k, ...} (the rows are saved by reference:
:mod:`nbtools.checkpoint.rows`), a tuple {"$tuple": [...]}, a dict with non-string keys (optimizer state is keyed by
int) {"$items": [[k, v], ...]}, and anything else ({"$pickle": i}) goes through torch.save
into the small side file. That file is data, never code: it is read with
``torch.load(weights_only=True)`` and an allowlist of the types nbtools writes (NumPy arrays,
scalars and dtypes beside what torch allows: tensors, dtypes, devices, sets, bytes, ...), so a
crafted side file cannot run anything on restore (:func:`load_extras`); a value outside it is
refused when saving, naming its place (:func:`dump_extras`).

>>> packer = Packer()
>>> tree = packer.encode({"w": torch.zeros(2), "step": 3, "pair": (1, 2), 0: "x"}, "obj")
>>> tree["$items"][0], tree["$items"][2]
(['w', {'$tensor': 0}], ['pair', {'$tuple': [1, 2]}])
>>> tensor_indices(tree)
[0]
>>> decode(tree, [torch.ones(2)], [])["w"].tolist()
[1.0, 1.0]
"""
from __future__ import annotations

import collections
import io
import pickle
import re
import zipfile

import numpy as np
import torch

from .format import TREE_MAX_DEPTH, Damaged


def _streamable(x: torch.Tensor) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and x.device.type in ("cpu", "cuda") and not x.is_quantized)


class Packer:
    """Encodes state trees; ``ref(tensor, path)`` may answer a JSON node that stands for a
    tensor (None: the tensor is saved as it is)."""

    def __init__(self, ref=None):
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.extras: list = []
        self.extra_paths: list[str] = []     # where each extra sits (for messages)
        self.ref = ref

    def encode(self, x, path: str, depth: int = 0):
        if x is None or type(x) in (bool, int, float, str):
            return x
        if depth >= TREE_MAX_DEPTH:
            where = path if len(path) <= 80 else path[:60] + "/..."
            raise TypeError(f"cannot checkpoint {where!r}: it nests over {TREE_MAX_DEPTH} "
                            "levels deep (lists, tuples, dicts), deeper than a checkpoint "
                            "holds; flatten it in state_dict()")
        if isinstance(x, torch.Tensor) and self.ref is not None:
            node = self.ref(x, path)
            if node is not None:
                return node
        if isinstance(x, torch.Tensor) and _streamable(x):
            self.tensors.append((path, x))
            return {"$tensor": len(self.tensors) - 1}
        if type(x) is list:
            return [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
        if type(x) is tuple:
            return {"$tuple": [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]}
        if type(x) in (dict, collections.OrderedDict):
            plain = type(x) is dict and all(type(k) is str and not k.startswith("$") for k in x)
            if plain:
                return {k: self.encode(v, f"{path}/{k}", depth + 1) for k, v in x.items()}
            out = {"$items": [[self.encode(k, f"{path}/<key>", depth + 1),
                                self.encode(v, f"{path}/{k}", depth + 1)]
                              for k, v in x.items()]}
            if type(x) is collections.OrderedDict:
                out["$odict"] = True
                meta = getattr(x, "_metadata", None)     # module state_dict versions
                if meta is not None:
                    out["$meta"] = self.encode(meta, f"{path}/<metadata>", depth + 1)
            return out
        self.extras.append(x)
        self.extra_paths.append(path)
        return {"$pickle": len(self.extras) - 1}


def walk(x, on_tensor, extras=(), live=None, on_rows=None):
    """Decode the encoded tree ``x``, calling ``on_tensor(index, live_part)`` at each tensor node.

    ``live`` is the object's current state (or None), walked beside the tree: ``live_part`` is
    what sits at the same place in it (None where the two differ). What ``on_tensor`` returns
    stands for the tensor in the result; ``$pickle`` nodes become ``extras[i]`` (None when
    ``extras`` is short, as when only the tensors are wanted); ``$rows`` nodes become
    ``on_rows(node)`` (None without it).
    """
    if isinstance(x, list):
        same = isinstance(live, (list, tuple)) and len(live) == len(x)
        return [walk(v, on_tensor, extras, live[i] if same else None, on_rows)
                for i, v in enumerate(x)]
    if not isinstance(x, dict):
        return x
    if "$tensor" in x:
        return on_tensor(x["$tensor"], live)
    if "$rows" in x:
        return on_rows(x) if on_rows is not None else None
    if "$tuple" in x:
        return tuple(walk(x["$tuple"], on_tensor, extras, live, on_rows))
    if "$pickle" in x:
        i = x["$pickle"]
        return extras[i] if i < len(extras) else None
    if "$items" in x:
        items = []
        for k, v in x["$items"]:
            key = walk(k, on_tensor, extras)
            try:
                hash(key)
            except TypeError:        # (a side-file value that cannot be a key: not ours)
                raise Damaged(f"a mapping's key is a {type(key).__name__}, which cannot be "
                              "one: not a state nbtools saved") from None
            part = None
            if (isinstance(live, dict) and isinstance(key, (str, int))
                    and not isinstance(key, bool)):
                part = live.get(key)
            items.append((key, walk(v, on_tensor, extras, part, on_rows)))
        if x.get("$odict"):
            out = collections.OrderedDict(items)
            if "$meta" in x:
                out._metadata = walk(x["$meta"], on_tensor, extras)
            return out
        return dict(items)
    live = live if isinstance(live, dict) else {}
    return {k: walk(v, on_tensor, extras, live.get(k), on_rows) for k, v in x.items()}


def decode(x, tensors, extras, on_rows=None):
    """The state tree ``x`` encodes, with its tensors and side-file values filled in (and
    ``$rows`` nodes by ``on_rows(node)``)."""
    return walk(x, lambda i, _: tensors[i], extras, on_rows=on_rows)


def rows_nodes(*trees) -> list[dict]:
    """The ``$rows`` nodes of the encoded trees (None trees are skipped)."""
    out = []
    for tree in trees:
        if tree is not None:
            walk(tree, lambda i, _: None, on_rows=out.append)
    return out


def live_tensors(encoded, live, out: dict) -> None:
    """Walk a saved tree beside the object's current state; map tensor index -> live tensor."""
    def take(i, part):
        if isinstance(part, torch.Tensor):
            out[i] = part
    walk(encoded, take, (), live)


def tensor_indices(*trees) -> list[int]:
    """Sorted indices of the tensors the encoded trees refer to (None trees are skipped)."""
    idx = set()
    for tree in trees:
        if tree is not None:
            walk(tree, lambda i, _: idx.add(i))
    return sorted(idx)


class UnsafeValueError(ValueError):
    """A value of the side file is not plain data (its type is outside the allowlist)."""


def _safe_globals() -> list:
    """The types beyond torch's own weights-only set that a side file may hold: NumPy arrays,
    scalars and dtypes (a loader's or a user's state keeps them)."""
    core = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    dtypes = {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDG"}
    return [core._reconstruct, core.scalar, np.ndarray, np.dtype, *sorted(dtypes, key=str)]


def load_extras(blob: bytes) -> list:
    """The side file's values, unpickled as data only: ``weights_only=True`` with
    :func:`_safe_globals`. Anything else (a function, a class, ``os.system``) raises
    :class:`UnsafeValueError` naming it; nothing of it runs."""
    _stored_only(blob)
    with torch.serialization.safe_globals(_safe_globals()):
        try:
            return torch.load(io.BytesIO(blob), weights_only=True)
        except pickle.UnpicklingError as e:
            text = str(e)
            # torch's message: a paragraph of advice, then the refused global, e.g.
            # "Unsupported global: GLOBAL posix.system was not an allowed global by default"
            found = re.search(r"(?:Unsupported global|Unsupported operand|GLOBAL)[^.\n]*", text)
            why = found.group(0).strip() if found else \
                (text.strip().splitlines() or [type(e).__name__])[-1]
            names = _globals_in(blob)
            raise UnsafeValueError(f"{why}; it refers to {', '.join(names)}" if names else why) \
                from None


def _stored_only(blob: bytes) -> None:
    """Raise ValueError where ``blob``, a zip archive, holds a compressed record: torch.save
    stores its records as they are, and a compressed one could inflate a few MB of file into
    GBs of memory. (Not a zip archive: torch.load reads it as a plain pickle, which holds its
    bytes as they are.)"""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            records = z.infolist()
    except zipfile.BadZipFile as e:
        if blob[:4] == b"PK\x03\x04":      # (what torch.load takes for an archive)
            raise ValueError(f"a damaged zip archive ({e})") from None
        return
    packed = [r.filename for r in records
              if r.compress_type != zipfile.ZIP_STORED or r.file_size > len(blob)]
    if packed:
        raise ValueError(f"its record(s) {packed[:3]} are compressed; torch.save stores them "
                         "as they are")


def _globals_in(blob: bytes) -> list[str]:
    """The ``module.name`` globals a pickle refers to, read by pickletools (nothing runs)."""
    import pickletools
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:            # (a truncated or malformed pickle: what was found so far)
        pass
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _safe_globals()}
    return [n for n in dict.fromkeys(names) if n not in allowed and not n.startswith(
        ("torch.", "collections.OrderedDict"))]


def dump_extras(values: list, paths: list) -> bytes:
    """``values`` as the side file's bytes, checked to load back through :func:`load_extras`:
    a value that would not (an object of a class of its own, a lambda, ...) raises
    TypeError naming its place and type, so no save makes a checkpoint restore refuses."""
    buf = io.BytesIO()
    torch.save(values, buf)
    blob = buf.getvalue()
    try:
        load_extras(blob)
    except UnsafeValueError:
        for value, path in zip(values, paths):
            one = io.BytesIO()
            torch.save([value], one)
            try:
                load_extras(one.getvalue())
            except UnsafeValueError as e:
                raise TypeError(
                    f"cannot checkpoint {path!r}: a {type(value).__module__}."
                    f"{type(value).__qualname__} is not plain data ({e}). Checkpoints hold "
                    "tensors, numbers, strings, lists, tuples, dicts, sets, bytes, torch "
                    "dtypes/devices and NumPy arrays/scalars; convert it to one of those in "
                    "state_dict()") from None
        raise
    return blob
