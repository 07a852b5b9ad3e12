"""The training step at GPU speed, every figure a ratio within one run.

Table 4,000,000 x 128 fp32, Adam, one lookup + a small loss + backward + optimizer step:
  nbtools host        OffloadedEmbedding(placement="host") + OffloadOptimizer(Adam): rows and
                      Adam state in pinned host RAM, zero-copy, fused kernel ("auto")
  nbtools host generic   the same with OffloadConfig(fused=False): stock Adam on the rows
  nbtools gpu         OffloadedEmbedding(placement="gpu"): the same API, rows on the GPU
  torch sparse        nn.Embedding(sparse=True) on the GPU + torch.optim.SparseAdam
at 4,096 and 65,536 uniform ids per step, and 65,536 Zipf(1.1) ids. Plus:
  traffic floor       a zero-copy gather of the step's unique rows [weight | m | v] plus the
                      scatter back, timed alone: the bytes an offloaded step must move
  host syncs/step     counted with torch.cuda.set_sync_debug_mode over timed steps
  small model step    word2vec-sized: two 59,754 x 100 tables, 4,096 pairs x (1 + 5) targets

Steps are timed as loops (one synchronisation at the end, none between steps), median of
several loops.

The cost of determinism: with ``--deterministic both``, the host and GPU placements
(and the small model) also run with OffloadConfig(deterministic=False), whose lookups' backward
sums duplicate ids with torch's atomic index_add_ instead of the fixed-order segment sum, and
"repeat diff" trains the same short run twice in each mode and reports how far apart the two
runs end (0 where the sums are fixed-order). ``--deterministic off`` runs every nbtools system
with atomics.

    python benchmarks/bench_step.py --out DIR          # GPU machine
    python benchmarks/bench_step.py --deterministic both \
        --only "nbtools host,nbtools gpu,small nbtools host,small nbtools gpu,repeat diff"
    python benchmarks/bench_step.py --quick            # a few systems, small, on a CPU
    python benchmarks/bench_step.py --own-floors --only "nbtools host,nbtools host rowwise,\
nbtools host bf16,nbtools host bf16 rowwise,nbtools host bf16+bf16 state,\
nbtools host bf16 rowwise+bf16 state"     # every storage combination vs its floor
"""
from __future__ import annotations

import argparse
import sys

import harness
import torch
from harness import count_syncs, follow, loop_ms, nbtools_step, torch_sparse_step
from torch import nn

import nbtools
from nbtools import hostmem
from nbtools.optim import OffloadConfig

# --quick: these systems only (each in a process of its own, like a full run)
QUICK = ("nbtools host", "nbtools host bf16 rowwise prefetch", "small nbtools host")


def stored_row_bytes(table) -> int:
    """A table's row as it stores it: weight, optimizer state and padding."""
    return table._layout.width * table._layout.unit.itemsize


def traffic_floor_ms(n, dim, batches, device, width_factor=3):
    """Gather + scatter of each batch's unique [weight | m | v] rows on a zero-copy view."""
    width = int(dim * width_factor)
    h = hostmem.HostTensor((n, width), torch.float32, name="floor")
    view = h.view()
    uniq = [torch.unique(b) for b in batches]
    rows = [torch.empty(u.numel(), width, device=device) for u in uniq]

    def step(i):
        hostmem.gather_rows(view, uniq[i])
        hostmem.scatter_rows(view, uniq[i], rows[i])
    ms = loop_ms(step, list(range(len(batches))), device)
    h.close()
    return ms


def small_model_ms(device, system, pairs=4096, negatives=5, vocab=59_754, dim=100, steps=30,
                   deterministic=True):
    """word2vec-sized step: input and output tables, with ``system`` one of "nbtools host",
    "nbtools gpu", "nbtools host cache", "torch sparse" (" atomics" after it:
    OffloadConfig(deterministic=False)). Returns (ms per step, host syncs per step)."""
    if system.endswith(" atomics"):
        system, deterministic = system[: -len(" atomics")], False
    gen = torch.Generator(device="cpu").manual_seed(1)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    batches = [(torch.multinomial(zipf, pairs, True, generator=gen).to(device),
                torch.multinomial(zipf, pairs * (1 + negatives), True, generator=gen)
                .view(pairs, 1 + negatives).to(device)) for _ in range(steps)]

    def sgns(v, u):
        scores = torch.bmm(u, v.unsqueeze(2)).squeeze(2)
        sign = torch.ones_like(scores)
        sign[:, 1:] = -1
        return -torch.nn.functional.logsigmoid(sign * scores).sum(1).mean()

    if system == "torch sparse":
        a = nn.Embedding(vocab, dim, sparse=True).to(device)
        b = nn.Embedding(vocab, dim, sparse=True).to(device)
        opt = torch.optim.SparseAdam(list(a.parameters()) + list(b.parameters()), lr=1e-3)
    else:
        placement = system.split()[1]
        kw = {}
        if system.endswith("cache"):       # a quarter of the rows in a GPU cache, warm from counts
            kw["cache_bytes"] = harness.cache_bytes_for(vocab, dim, 0.25)
        a = nbtools.OffloadedEmbedding(vocab, dim, device=device, name="in", placement=placement,
                                       **kw)
        b = nbtools.OffloadedEmbedding(vocab, dim, device=device, name="out", placement=placement,
                                       **kw)
        if kw:
            counts = (zipf * 1e7).long()
            a.warm_cache(counts)
            b.warm_cache(counts)
        opt = nbtools.OffloadOptimizer(torch.optim.Adam, [a, b], lr=1e-3,
                                       config=OffloadConfig(deterministic=deterministic))

    def step(batch):
        opt.zero_grad()
        sgns(a(batch[0]), b(batch[1])).backward()
        opt.step()
    return loop_ms(step, batches, device), count_syncs(step, batches[:10], device)


SYSTEMS = {   # name -> table options (None: torch's own)
    "torch sparse": None,
    "nbtools host": dict(placement="host"),
    "nbtools host generic": dict(placement="host", fused=False),
    "nbtools host eager": dict(placement="host", cuda_graphs=False),
    "nbtools gpu": dict(placement="gpu"),
    # a GPU cache of hot rows (a share of the rows), bf16 storage with fp32 math
    "nbtools host cache5%": dict(placement="host", cache_share=0.05),
    "nbtools host cache25%": dict(placement="host", cache_share=0.25),
    "nbtools host bf16": dict(placement="host", dtype=torch.bfloat16),
    "nbtools host bf16+bf16 state": dict(placement="host", dtype=torch.bfloat16,
                                         state_dtype=torch.bfloat16),
    "nbtools host prefetch": dict(placement="host", prefetch=True),
    # ids handed over as pinned host tensors: the prefetch's copy and dedup run beside the
    # last update
    "nbtools host prefetch host-ids": dict(placement="host", prefetch=True, host_ids=True),
    # the update writes host memory itself, in series, instead of writing behind the next step
    "nbtools host write-through": dict(placement="host", write_behind=False),
    # row-wise optimizers (one fp32 accumulator per row; Adam's first moment per
    # value and its second per row); bf16 weights with RowWiseAdagrad: 260 B a row at dim 128
    "nbtools host rowwise": dict(placement="host", optimizer="rowwise_adagrad"),
    "nbtools host bf16 rowwise": dict(placement="host", dtype=torch.bfloat16,
                                      optimizer="rowwise_adagrad"),
    "nbtools host bf16 rowwise write-through": dict(placement="host", dtype=torch.bfloat16,
                                                    optimizer="rowwise_adagrad",
                                                    write_behind=False),
    "nbtools host bf16 rowwise+bf16 state": dict(placement="host", dtype=torch.bfloat16,
                                                 state_dtype=torch.bfloat16,
                                                 optimizer="rowwise_adagrad"),
    "nbtools gpu bf16 rowwise": dict(placement="gpu", dtype=torch.bfloat16,
                                     optimizer="rowwise_adagrad"),
    "nbtools host bf16 rowwise prefetch": dict(placement="host", dtype=torch.bfloat16,
                                               optimizer="rowwise_adagrad", prefetch=True),
    "nbtools host bf16 partial-rowwise": dict(placement="host", dtype=torch.bfloat16,
                                              optimizer="partial_rowwise_adam"),
}
# every storage combination (fp32 weights take fp32 state only) and its own
# traffic floor (--own-floors): weights, state, optimizer -> system
COMBINATIONS = {
    ("fp32", "fp32", "Adam"): "nbtools host",
    ("fp32", "fp32", "RowWiseAdagrad"): "nbtools host rowwise",
    ("bf16", "fp32", "Adam"): "nbtools host bf16",
    ("bf16", "fp32", "RowWiseAdagrad"): "nbtools host bf16 rowwise",
    ("bf16", "bf16", "Adam"): "nbtools host bf16+bf16 state",
    ("bf16", "bf16", "RowWiseAdagrad"): "nbtools host bf16 rowwise+bf16 state",
}
# ... and with the next step's lookup started during this one (table.prefetch), so that its
# gather runs beside this step's backward and update
PREFETCHED = {key: f"{name} prefetch" for key, name in COMBINATIONS.items()}
for _key, _name in PREFETCHED.items():
    SYSTEMS.setdefault(_name, dict(SYSTEMS[COMBINATIONS[_key]], prefetch=True))
EXTRA = ["floor", "small torch sparse", "small nbtools host", "small nbtools gpu",
         "small nbtools host cache"]
# --deterministic both: these also run with OffloadConfig(deterministic=False) ("... atomics")
DETERMINISM = ["nbtools host", "nbtools gpu", "nbtools host cache25%",
               "nbtools host bf16+bf16 state", "small nbtools host", "small nbtools gpu"]
for _name in DETERMINISM:
    if _name in SYSTEMS:
        SYSTEMS[f"{_name} atomics"] = dict(SYSTEMS[_name], deterministic=False)


def repeat_diff(device, rows=200_000, dim=128, n=65536, steps=30) -> dict:
    """How far apart two identical runs end (max |difference| of the weights), for each
    placement and OffloadConfig.deterministic: 30 Adam steps of Zipf(1.1) ids, each position's
    gradient row a different multiple of its row (equal gradient rows would sum to the same
    bits in any order, hiding the atomics' order)."""
    gen = torch.Generator().manual_seed(3)
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64).pow(1.1)
    batches = [(torch.multinomial(p, n, True, generator=gen).to(device),
                torch.randn(n, 1, generator=gen).to(device)) for _ in range(steps)]
    out = {}
    for placement in ("host", "gpu") if device.type == "cuda" else ("host",):
        for det in (True, False):
            ends = []
            for _ in range(2):
                table = nbtools.OffloadedEmbedding(rows, dim, device=device, name="t",
                                                   placement=placement)
                with torch.no_grad():
                    table.weight.copy_(torch.randn(rows, dim,
                                                   generator=torch.Generator().manual_seed(0)))
                opt = nbtools.OffloadOptimizer(torch.optim.Adam, [table], lr=1e-3,
                                               config=OffloadConfig(deterministic=det))
                for ids, w in batches:
                    (table(ids) * w).square().sum().backward()
                    opt.step()
                    opt.zero_grad()
                opt.synchronize()
                ends.append(table.weight.float().cpu().clone())
                del table, opt
            diff = (ends[0] - ends[1]).abs().max().item()
            out[f"{placement}, deterministic={det}"] = diff
    return out


def make_cases(args, device):
    """The batches of each case, named by their full-size ids per step (--quick: 1/16 of them)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    zipf_p = 1.0 / torch.arange(1, min(args.rows, 1 << 24) + 1, dtype=torch.float64).pow(1.1)
    small, large = (256, 4096) if args.quick else (4096, 65536)
    cases = {
        "4,096 uniform": [torch.randint(0, args.rows, (small,), generator=gen) for _ in range(args.steps)],
        "65,536 uniform": [torch.randint(0, args.rows, (large,), generator=gen) for _ in range(args.steps)],
        "65,536 zipf1.1": [torch.multinomial(zipf_p, large, True, generator=gen) for _ in range(args.steps)],
    }
    return {k: [b.to(device) for b in v] for k, v in cases.items()}


def run_system(name, args, device) -> dict:
    """One system's figures (run in a process of its own, so no system inherits another's
    allocator state or captured graphs)."""
    cases = make_cases(args, device)
    if name == "repeat diff":
        return {"repeat_diff": repeat_diff(device, rows=min(args.rows, 200_000), dim=args.dim,
                                           steps=5 if args.quick else 30)}
    if name == "floor":
        out = {c: traffic_floor_ms(args.rows, args.dim, cases[c], device)
               for c in ("65,536 uniform", "65,536 zipf1.1")}
        # bf16 weights + bf16 state: rows of half the bytes (768 B at dim 128)
        out["65,536 uniform, bf16 rows"] = traffic_floor_ms(
            args.rows, args.dim, cases["65,536 uniform"], device, width_factor=1.5)
        # bf16 weights + RowWiseAdagrad's one fp32 accumulator: 2 * dim + 4 bytes a row, as
        # a host table stores it: padded to whole 32-byte sectors (nbtools.store.layout.row_padding)
        from nbtools.store.layout import RowLayout, row_padding
        lay = RowLayout(args.dim, torch.bfloat16, torch.float32, 1, (1,))
        out["65,536 uniform, bf16 rowwise rows"] = traffic_floor_ms(
            args.rows, args.dim, cases["65,536 uniform"], device,
            width_factor=(lay.used + row_padding(lay)) / args.dim)
        return {"floor_ms": out}
    if name.startswith("small "):
        ms, syncs = small_model_ms(device, name[len("small "):], steps=4 if args.quick else 30,
                                   vocab=5_000 if args.quick else 59_754,
                                   deterministic=args.deterministic != "off")
        return {"small_model": {name[len("small "):]: ms}, "syncs": {name: syncs}}
    kw = dict(SYSTEMS[name]) if SYSTEMS[name] is not None else None
    if kw is not None and args.deterministic == "off":
        kw["deterministic"] = False
    if kw is not None and kw.pop("host_ids", False):
        pin = device.type == "cuda"           # pinned, as a loader's batches are
        cases = {k: [b.cpu().pin_memory() if pin else b.cpu() for b in v]
                 for k, v in cases.items()}
    step, keep = (torch_sparse_step(args.rows, args.dim, device) if kw is None else
                  nbtools_step(args.rows, args.dim, device, **kw))
    out = {"ms": {}, "syncs": {}}
    for batches in cases.values():        # a prefetching step needs each batch's successor
        follow(step, batches)
    for case, batches in cases.items():
        out["ms"][f"{name} | {case}"] = loop_ms(step, batches, device,
                                                repeats=2 if args.quick else 5)
    out["syncs"][name] = count_syncs(step, cases["4,096 uniform"][:10], device)
    if args.own_floors and kw is not None and kw.get("placement") == "host":
        # this table's rows as it stores them (optimizer state and padding included), moved
        # by the floor's gather + scatter over the same ids
        row_bytes = stored_row_bytes(keep[0])
        del step, keep
        out["own_floor"] = {name: {"row_bytes": row_bytes, "ms": traffic_floor_ms(
            args.rows, args.dim, cases["65,536 uniform"], device,
            width_factor=row_bytes / 4 / args.dim)}}
    return out


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--system", default=None, help=argparse.SUPPRESS)   # one system, in a child
    ap.add_argument("--only", default=None, help="run these systems only (comma-separated names, "
                    "e.g. 'small nbtools gpu')")
    ap.add_argument("--own-floors", action="store_true",
                    help="each host system also times the traffic floor of its own rows (its "
                    "row bytes, state and padding included) over the 65,536 uniform ids")
    ap.add_argument("--deterministic", choices=("on", "off", "both"), default="on",
                    help="OffloadConfig.deterministic of the nbtools systems: on (the default), "
                    "off (atomics), both (the host, GPU and small-model systems in each mode, "
                    "their time ratios, and 'repeat diff': how far two identical runs end apart)")
    ap.add_argument("--backward-on-loop-thread", action="store_true",
                    help="each backward on the loop's thread (torch.autograd."
                    "set_multithreading_enabled(False), as nbtools' train() does by default), "
                    "not handed to autograd's device thread")
    args = ap.parse_args()
    device = harness.setup(args)
    if args.backward_on_loop_thread:
        torch.autograd.set_multithreading_enabled(False)
    if args.quick:
        args.rows, args.dim, args.steps = 100_000, 32, 3
        args.only = args.only or ",".join(QUICK)
    if args.system:
        harness.report(run_system(args.system, args, device))
        return
    res = {"device": harness.device_name(device),
           "torch": torch.__version__, "rows": args.rows, "dim": args.dim, "ms": {}, "syncs": {},
           "floor_ms": {}, "small_model": {}, "repeat_diff": {}, "own_floor": {},
           "deterministic": args.deterministic}
    print(f"# {res['device']}  table {args.rows:,} x {args.dim} fp32, Adam; each system in a "
          "process of its own" + (" (--quick: 1/16 of the ids per step)" if args.quick else ""),
          flush=True)
    both = args.deterministic == "both"
    names = [n for n in SYSTEMS if (device.type == "cuda" or SYSTEMS[n] is not None)
             and (both or not n.endswith(" atomics"))] + \
        [n for n in EXTRA if device.type == "cuda" or "torch" not in n and n != "floor"] + \
        ([f"{n} atomics" for n in DETERMINISM if n.startswith("small ")] + ["repeat diff"]
         if both else [])
    if args.only:      # with --deterministic both, each named system's atomics twin too
        only = [n for n in args.only.split(",") for n in ([n, f"{n} atomics"] if both else [n])]
        names = [n for n in only if n in names]
    for name in names:
        cmd = [sys.executable, __file__, "--system", name, "--rows", str(args.rows), "--dim",
               str(args.dim), "--steps", str(args.steps), "--device", args.device,
               "--deterministic", args.deterministic] + (["--quick"] if args.quick else []) + \
            (["--own-floors"] if args.own_floors else []) + \
            (["--backward-on-loop-thread"] if args.backward_on_loop_thread else [])
        got = harness.run_child(name, cmd)
        if got is None:
            continue
        for key, value in got.items():
            res[key].update(value)
        print(f"{name:<24} done", flush=True)

    ms = res["ms"]
    print(f"\n## step time, {args.rows:,} x {args.dim}, Adam ({res['device']})")
    for k, v in ms.items():
        print(f"{k:<44}{v:9.3f} ms")
    print("\n## ratios")
    ratios = {}
    get = lambda k: ms.get(k)

    def ratio(key, num, den):
        if num is not None and den:
            ratios[key] = num / den
    ratio("host / torch sparse, 4,096 ids (target <= 1.5)", get("nbtools host | 4,096 uniform"),
          get("torch sparse | 4,096 uniform"))
    for case in ("65,536 uniform", "65,536 zipf1.1"):
        ratio(f"host / traffic floor, {case}" + (" (target <= 1.1)" if "uniform" in case else ""),
              get(f"nbtools host | {case}"), res["floor_ms"].get(case))
        ratio(f"host prefetch / traffic floor, {case}", get(f"nbtools host prefetch | {case}"),
              res["floor_ms"].get(case))
        ratio(f"host prefetch / host, {case}", get(f"nbtools host prefetch | {case}"),
              get(f"nbtools host | {case}"))
        ratio(f"host write-through / traffic floor, {case}",
              get(f"nbtools host write-through | {case}"), res["floor_ms"].get(case))
        ratio(f"host prefetch host-ids / traffic floor, {case}",
              get(f"nbtools host prefetch host-ids | {case}"), res["floor_ms"].get(case))
    # RowWiseAdagrad with bf16 weights moves 260 of fp32 Adam's 1,536 bytes a row
    for case in ("65,536 uniform", "65,536 zipf1.1"):
        ratio(f"host bf16 rowwise / host (fp32 Adam), {case} (target <= 0.3)",
              get(f"nbtools host bf16 rowwise | {case}"), get(f"nbtools host | {case}"))
        ratio(f"host bf16 partial-rowwise / host (fp32 Adam), {case}",
              get(f"nbtools host bf16 partial-rowwise | {case}"), get(f"nbtools host | {case}"))
    ratio("host bf16 rowwise / its traffic floor, 65,536 uniform (target <= 1.1)",
          get("nbtools host bf16 rowwise | 65,536 uniform"),
          res["floor_ms"].get("65,536 uniform, bf16 rowwise rows"))
    ratio("host bf16+bf16 state / its traffic floor, 65,536 uniform (target <= 1.1)",
          get("nbtools host bf16+bf16 state | 65,536 uniform"),
          res["floor_ms"].get("65,536 uniform, bf16 rows"))
    for case in ("4,096 uniform", "65,536 uniform", "65,536 zipf1.1"):
        ratio(f"host / torch sparse, {case}", get(f"nbtools host | {case}"), get(f"torch sparse | {case}"))
        ratio(f"gpu placement / torch sparse, {case} (target <= 1.1)", get(f"nbtools gpu | {case}"),
              get(f"torch sparse | {case}"))
        ratio(f"host fused / host generic, {case}", get(f"nbtools host | {case}"),
              get(f"nbtools host generic | {case}"))
        ratio(f"host graphs / host eager, {case}", get(f"nbtools host | {case}"),
              get(f"nbtools host eager | {case}"))
    for name in DETERMINISM:
        if name.startswith("small "):
            ratio(f"determinism cost: {name} / atomics (target <= 1.03)",
                  res["small_model"].get(name[len("small "):]),
                  res["small_model"].get(name[len("small "):] + " atomics"))
            continue
        for case in ("4,096 uniform", "65,536 uniform", "65,536 zipf1.1"):
            ratio(f"determinism cost: {name[8:]} / atomics, {case} (target <= 1.03)",
                  get(f"{name} | {case}"), get(f"{name} atomics | {case}"))
    sm = res["small_model"]
    ratio("small model: host / torch sparse", sm.get("nbtools host"), sm.get("torch sparse"))
    ratio("small model: gpu / torch sparse", sm.get("nbtools gpu"), sm.get("torch sparse"))
    ratio("small model: host speed / gpu speed (target >= 0.8)", sm.get("nbtools gpu"), sm.get("nbtools host"))
    ratio("small model: host+cache speed / gpu speed (target >= 0.8)", sm.get("nbtools gpu"),
          sm.get("nbtools host cache"))
    for name in ("nbtools host cache5%", "nbtools host cache25%", "nbtools host bf16",
                 "nbtools host bf16+bf16 state"):
        for case in ("65,536 uniform", "65,536 zipf1.1"):
            ratio(f"{name[8:]} / torch sparse, {case}", get(f"{name} | {case}"),
                  get(f"torch sparse | {case}"))
    for name, own in res["own_floor"].items():
        ratio(f"{name[8:]} / its own traffic floor ({own['row_bytes']} B rows), 65,536 uniform"
              + (" (target <= 1.1)" if name in COMBINATIONS.values()
                 or name in PREFETCHED.values() else ""),
              get(f"{name} | 65,536 uniform"), own["ms"])
    res["ratios"] = ratios
    for k, v in ratios.items():
        print(f"{k:<62}{v:8.2f}x")
    ratio("host bf16+bf16 state / its traffic floor, 65,536 uniform",
          get("nbtools host bf16+bf16 state | 65,536 uniform"),
          res["floor_ms"].get("65,536 uniform, bf16 rows"))
    ratio("bf16 traffic floor / torch sparse, 65,536 uniform (what 1.5x needs: <= 1.5)",
          res["floor_ms"].get("65,536 uniform, bf16 rows"), get("torch sparse | 65,536 uniform"))
    for k, v in res["floor_ms"].items():
        print(f"traffic floor {k:<30}{v:9.3f} ms")
    if res["own_floor"]:
        print("\n## storage combinations, 65,536 uniform ids")
        print(f"{'weights':<8}{'state':<7}{'optimizer':<16}{'row B':>6}{'step ms':>9}"
              f"{'floor ms':>10}{'ratio':>7}{'x fp32 Adam':>13}{'prefetch ms':>13}{'ratio':>7}")
        base = get("nbtools host | 65,536 uniform")
        for key, name in COMBINATIONS.items():
            ahead = PREFETCHED[key]
            own = res["own_floor"].get(name) or res["own_floor"].get(ahead)
            t, ta = get(f"{name} | 65,536 uniform"), get(f"{ahead} | 65,536 uniform")
            if own is None or (t is None and ta is None):
                continue
            w, st, opt = key
            cells = [f"{t:>9.3f}", f"{own['ms']:>10.3f}", f"{t / own['ms']:>7.2f}",
                     f"{t / base:>13.2f}" if base else f"{'':>13}"] if t else \
                [f"{'':>9}", f"{own['ms']:>10.3f}", f"{'':>7}", f"{'':>13}"]
            if ta:        # against the floor timed in its own process, where it has one
                floor = (res["own_floor"].get(ahead) or own)["ms"]
                cells += [f"{ta:>13.3f}", f"{ta / floor:>7.2f}"]
            print(f"{w:<8}{st:<7}{opt:<16}{own['row_bytes']:>6}" + "".join(cells))
    for k, v in res["syncs"].items():
        print(f"host syncs per step, {k:<24} {v if v is None else f'{v:.1f}'}")
    for k, v in sm.items():
        print(f"small model {k:<32}{v:9.3f} ms")
    for k, v in res["repeat_diff"].items():
        print(f"two identical runs end apart by, {k:<32}{v:.3g}")
    harness.save(args, "step.json", res)


if __name__ == "__main__":
    main()
