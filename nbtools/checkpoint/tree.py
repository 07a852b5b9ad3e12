"""State trees <-> JSON, and the one walker of an encoded tree.

JSON keeps everything readable; a tensor becomes {"$tensor": i} (its bytes go to the data
files), a view of a disk table's rows {"$rows": k, ...} (the rows are saved by reference:
:mod:`nbtools.checkpoint.rows`), a tuple {"$tuple": [...]}, a dict with non-string keys (optimizer state is keyed by
int) {"$items": [[k, v], ...]}, and anything else ({"$pickle": i}) goes through torch.save
into the small side file, so nothing is ever lost to the format.

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

import torch


def _streamable(x: torch.Tensor) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and x.device.type in ("cpu", "cuda") and not x.is_quantized)


class Packer:
    """Encodes state trees; ``ref(tensor, path)`` may answer a JSON node that stands for a
    tensor (None: the tensor is saved as it is)."""

    def __init__(self, ref=None):
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.extras: list = []
        self.ref = ref

    def encode(self, x, path: str):
        if x is None or type(x) in (bool, int, float, str):
            return x
        if isinstance(x, torch.Tensor) and self.ref is not None:
            node = self.ref(x, path)
            if node is not None:
                return node
        if isinstance(x, torch.Tensor) and _streamable(x):
            self.tensors.append((path, x))
            return {"$tensor": len(self.tensors) - 1}
        if type(x) is list:
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(x)]
        if type(x) is tuple:
            return {"$tuple": [self.encode(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if type(x) in (dict, collections.OrderedDict):
            plain = type(x) is dict and all(type(k) is str and not k.startswith("$") for k in x)
            if plain:
                return {k: self.encode(v, f"{path}/{k}") for k, v in x.items()}
            out = {"$items": [[self.encode(k, f"{path}/<key>"), self.encode(v, f"{path}/{k}")]
                              for k, v in x.items()]}
            if type(x) is collections.OrderedDict:
                out["$odict"] = True
                meta = getattr(x, "_metadata", None)     # module state_dict versions
                if meta is not None:
                    out["$meta"] = self.encode(meta, f"{path}/<metadata>")
            return out
        self.extras.append(x)
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
