"""Train the embedded `tiny` model (DeepSeek-V3.2 architecture at toy size) on CPU in a few minutes.

    python -m models.tiny.train            # trains, writes jtilert/assets/tiny/, then checks decoding
    python -m models.tiny.train --check    # only the decoding checks, on the committed checkpoint

Training is written against the per-layer model (one nnx module per layer, ops swapped through
`jtilert.backend`) that the layer stacks replaced: to retrain, check out commit ba89fb0, whose
checkpoint (layout 1) today's jtilert loads. `--check` runs on today's model.

Byte-level tokens (vocab 256) from models/tiny/data/python_reference.txt. One optimizer step trains,
from the same forward pass over a batch of windows:
  * the main model: next-token cross-entropy;
  * the MTP block: cross-entropy on token i+2 from the main model's final hidden state at i
    (stop-gradient) and the embedding of token i+1 (embedding and lm head are shared, as in DeepSeek-V3);
  * the DSA lightning indexers (one per layer and one in the MTP block): KL divergence from the main
    attention's head-summed, L1-normalised dense distribution (rebuilt from the sown absorbed queries
    and the cached latents / rope keys) to softmax of the index scores. The indexer's inputs are
    stop-gradient, so this loss trains only the indexers, and the indexers get no other gradient
    (top-k selection is discrete);
  * the MoE routers' `e_score_correction_bias`: no gradient, DeepSeek-V3's auxiliary-loss-free
    balancing (bias += rate · sign(mean load − expert load) after every step).
The first `--dense-steps` steps run attention densely (index_topk = window) — the indexer
warm-up of DeepSeek-V3.2 — then the real index_topk, so sparse attention runs for the rest of training.
Windows are 256 bytes (4 per step), and on every 4th step 512 bytes (2 per step): the model sees every
distance up to 511 and decodes well up to 512 positions (beyond, it degrades: RoPE distances it never
saw). The indexer loss uses every 4th query position.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python models/tiny/train.py`
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jtilert  # noqa: E402
from jtilert.store import checkpoint  # noqa: E402
from jtilert.ops import reference  # noqa: E402
from jtilert.model.transformer import Indexer, Transformer, init_cache  # noqa: E402

F32 = jnp.float32
DATA = Path(__file__).resolve().parent / "data" / "python_reference.txt"
ASSETS = ROOT / "jtilert" / "assets" / "tiny"


# ---- training-only hooks ------------------------------------------------------------------------

class _TrainIndexer(Indexer):
    """The indexer with stop-gradient inputs: its KL loss must not reach the main model."""

    def __call__(self, x, qa, *args):
        return super().__call__(jax.lax.stop_gradient(x), jax.lax.stop_gradient(qa), *args)


_ROUTES: list | None = None


def _recording_route(cfg, x, gate, bias):
    weights, ids = reference.route(cfg, x, gate, bias)
    if _ROUTES is not None:
        _ROUTES.append(ids)
    return weights, ids


@contextlib.contextmanager
def record_routes():
    """Collect the expert ids chosen by every MoE layer traced inside the block (for the bias update)."""
    global _ROUTES
    from jtilert import backend   # the per-layer model's op switch (commit ba89fb0)
    saved, _ROUTES = backend.REFERENCE.route, []
    backend.REFERENCE.route = _recording_route
    try:
        yield _ROUTES
    finally:
        backend.REFERENCE.route, _ROUTES = saved, None


def _masked_dense_mla(q_lat, q_pe, kv_cache, pe_cache, idx, valid, scale):
    """`reference.sparse_mla` computed as dense attention under the top-k mask: the same result, and
    cheaper than gathering rows when the top-k is the whole window (the dense warm-up)."""
    t, s = idx.shape[0], kv_cache.shape[0]
    mask = jnp.zeros((t, s), bool).at[jnp.arange(t)[:, None], idx].max(valid)
    kv = kv_cache.astype(F32)
    sc = (jnp.einsum("thl,sl->ths", q_lat.astype(F32), kv)
          + jnp.einsum("thr,sr->ths", q_pe.astype(F32), pe_cache.astype(F32))) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None, :], sc, -jnp.inf), axis=-1)
    return jnp.einsum("ths,sl->thl", p, kv)


@contextlib.contextmanager
def dense_attention():
    from jtilert import backend   # the per-layer model's op switch (commit ba89fb0)
    saved, backend.REFERENCE.sparse_mla = backend.REFERENCE.sparse_mla, _masked_dense_mla
    try:
        yield
    finally:
        backend.REFERENCE.sparse_mla = saved


def attention_modules(model: Transformer):
    return [layer.self_attn for layer in model.layers] + ([model.mtp.layer.self_attn] if model.mtp else [])


def routers(model: Transformer):
    moe = [layer.mlp for layer in model.layers] + ([model.mtp.layer.mlp] if model.mtp else [])
    return [m.gate for m in moe if hasattr(m, "gate") and hasattr(m.gate, "e_score_correction_bias")]


# ---- model ----------------------------------------------------------------------------------------

def new_model(cfg, seed: int) -> Transformer:
    """fp32 model with training-friendly init: norms at 1, biases at 0, residual outputs scaled down."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed), fmt="fp32")
    n_res = 2 * (cfg.num_hidden_layers + 1)
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        name = path[-1]
        parent = path[-2] if len(path) > 1 else ""
        if parent in ("input_layernorm", "post_attention_layernorm", "q_a_layernorm", "kv_a_layernorm",
                      "norm", "enorm", "hnorm", "k_norm") and name == "weight":
            var[...] = jnp.ones_like(var[...])
        elif name in ("bias", "e_score_correction_bias"):
            var[...] = jnp.zeros_like(var[...])
        elif parent in ("o_proj", "down_proj", "down") and name == "weight":
            var[...] = var[...] / math.sqrt(n_res)
    for att in attention_modules(model):
        if att.indexer is not None:
            att.indexer.__class__ = _TrainIndexer
    return model


def loss_terms(graphdef, params, window, cfg, topk, kl_stride=1):
    """Losses of one window [T + 2], the expert ids each MoE layer chose, and per indexer its recall:
    the share of the dense attention mass that its top-`topk` positions hold (positions >= topk).
    The indexer KL and recall use every `kl_stride`-th query position (the dense target is the
    costliest part of the indexer loss)."""
    t = window.shape[0] - 2
    x, y1, y2 = window[:t], window[1:t + 1], window[2:t + 2]
    model = nnx.merge(graphdef, params)

    def forward(m):
        cache = init_cache(cfg, t, F32)
        logits, hidden, cache = m(x, jnp.int32(0), cache)
        mtp_logits, cache = m.draft(jax.lax.stop_gradient(hidden), y1, jnp.int32(0), cache)
        return logits, mtp_logits, cache

    with record_routes() as routes:
        (logits, mtp_logits, cache), inter = nnx.capture(forward, nnx.Intermediate)(model)
        routes = list(routes)

    def xent(lg, y):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), y[:, None], axis=-1))

    sown = [inter["layers"][i]["self_attn"] for i in range(cfg.num_hidden_layers)]
    caches = list(cache["layers"])
    if model.mtp is not None:
        sown.append(inter["mtp"]["layer"]["self_attn"])
        caches.append(cache["mtp"])
    rows = jnp.arange(kl_stride - 1, t, kl_stride)
    visible = jnp.arange(t)[None, :] <= rows[:, None]
    kls, recalls = [], []
    for s, c in zip(sown, caches):
        q_lat, q_pe, scores = s["q_lat"][0][rows], s["q_pe"][0][rows], s["indexer"]["scores"][0][rows]
        logits_att = (jnp.einsum("thl,sl->ths", q_lat, c["kv"]) + jnp.einsum("thr,sr->ths", q_pe, c["pe"]))
        logits_att = jnp.where(visible[:, None, :], logits_att * cfg.softmax_scale, -jnp.inf)
        p = jax.nn.softmax(logits_att, axis=-1).sum(1)
        p = jax.lax.stop_gradient(p / p.sum(-1, keepdims=True))  # [T, S]
        logq = jax.nn.log_softmax(scores, axis=-1)
        kl = jnp.where(visible & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - logq), 0.0).sum(-1)
        kls.append(kl.mean())
        idx = reference.topk_positions(scores, topk)
        kept = jnp.where(idx >= 0, jnp.take_along_axis(p, jnp.maximum(idx, 0), axis=-1), 0.0).sum(-1)
        recalls.append(jnp.sum(jnp.where(rows >= topk, kept, 0.0)) / jnp.sum(rows >= topk))
    losses = {"main": xent(logits, y1), "mtp": xent(mtp_logits, y2), "kl": jnp.stack(kls),
              "recall": jnp.stack(recalls)}
    return losses, jnp.stack(routes)


def make_train_step(graphdef, cfg, tx, w_mtp, w_kl, bias_rate, topk, kl_stride):
    def batch_loss(params, windows):
        losses, routes = jax.vmap(functools.partial(loss_terms, graphdef, cfg=cfg, topk=topk, kl_stride=kl_stride),
                                  in_axes=(None, 0))(params, windows)
        losses = jax.tree.map(lambda v: v.mean(0), losses)
        total = losses["main"] + w_mtp * losses["mtp"] + w_kl * losses["kl"].sum()
        return total, (losses, routes)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, windows):
        (_, (losses, routes)), grads = jax.value_and_grad(batch_loss, has_aux=True)(params, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # Auxiliary-loss-free balancing: routes [B, n_moe, T, k] -> per-layer expert loads.
        n_moe = routes.shape[1]
        ids = jnp.moveaxis(routes, 1, 0).reshape(n_moe, -1)
        loads = jax.vmap(lambda i: jnp.zeros(cfg.n_routed_experts, F32).at[i].add(1.0))(ids)
        delta = bias_rate * jnp.sign(loads.mean(-1, keepdims=True) - loads)
        model = nnx.merge(graphdef, params)
        for r, d in zip(routers(model), delta):
            r.e_score_correction_bias[...] = r.e_score_correction_bias[...] + d
        params = nnx.state(model, nnx.Param)
        losses["load"] = loads.max(-1) / loads.mean(-1)  # max expert load / mean, per MoE layer
        return params, opt_state, losses
    return step


# ---- data -----------------------------------------------------------------------------------------

def load_bytes(path: Path = DATA) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)


def batches(data: np.ndarray, batch: int, window: int, seed: int):
    """Random windows of window + 2 bytes, read cyclically (the text's end runs on into its start), so
    every byte, the first ones too, is seen with a full window of context equally often."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(window + 2)
    while True:
        starts = rng.integers(0, data.size, batch)
        yield data[(starts[:, None] + offsets[None, :]) % data.size]


# ---- main -----------------------------------------------------------------------------------------

def train(args) -> Transformer:
    cfg = jtilert.preset("tiny")
    data = load_bytes()
    print(f"data: {DATA.name}, {data.size} bytes; window {args.window}, batch {args.batch}, steps {args.steps}")
    dense_cfg = cfg.replace(index_topk=args.window)
    model = new_model(cfg, args.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    dense_graphdef, _ = nnx.split(new_model(dense_cfg, args.seed), nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"parameters: {n_params:,}")

    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps // 10), args.steps, args.lr * 0.05)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=args.wd, mask=decay_mask))
    opt_state = tx.init(params)
    kw = dict(tx=tx, w_mtp=args.w_mtp, w_kl=args.w_kl, bias_rate=args.bias_rate, topk=cfg.index_topk,
              kl_stride=args.kl_stride)
    steps = {"dense": make_train_step(dense_graphdef, cfg=dense_cfg, **kw),
             "sparse": make_train_step(graphdef, cfg=cfg, **kw)}
    n_dense = min(args.dense_steps, args.steps)
    long_batch = max(1, args.batch * args.window // args.long_window)  # the same tokens per step
    feeds = {False: batches(data, args.batch, args.window, args.seed),
             True: batches(data, long_batch, args.long_window, args.seed + 1)}
    t0, c0 = time.perf_counter(), time.process_time()
    pending: list = []
    tokens = 0
    for i in range(args.steps):
        phase = "dense" if i < n_dense else "sparse"
        long = phase == "sparse" and args.long_every > 0 and (i - n_dense) % args.long_every == args.long_every - 1
        windows = next(feeds[long])
        tokens += windows.shape[0] * (windows.shape[1] - 2)
        with dense_attention() if phase == "dense" else contextlib.nullcontext():
            # the long windows retrace the sparse step once, for their shape
            params, opt_state, losses = steps[phase](params, opt_state, jnp.asarray(windows))
        pending.append(losses)
        if len(pending) == 1:
            first_phase = phase
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            avg = jax.tree.map(lambda *v: np.mean(np.stack(v), 0), *jax.device_get(pending))
            pending = []
            fmt = functools.partial(np.array2string, precision=2, separator=" ")
            print(f"step {i + 1:5d} {first_phase:6s} main {avg['main']:.3f} mtp {avg['mtp']:.3f} kl {fmt(avg['kl'])} "
                  f"recall@{cfg.index_topk} {fmt(avg['recall'])} load {fmt(avg['load'])} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    jax.block_until_ready(params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"trained {args.steps} steps ({tokens:,} tokens) in {wall:.0f} s "
          f"wall, {cpu:.0f} s CPU (compilation included)")
    nnx.update(model, params)
    for att in attention_modules(model):
        if att.indexer is not None:
            att.indexer.__class__ = Indexer
    return model


def export(model: Transformer, fmt: str) -> Transformer:
    """A clean inference model holding the trained parameters, weights in `fmt`, computing in fp32
    (the checkpoint's default compute dtype): greedy decoding then does not hinge on bf16 rounding,
    so MTP verification (2 tokens per step) and plain decoding (1) agree even on near-ties."""
    out = Transformer(model.cfg, rngs=nnx.Rngs(0), fmt=fmt, dtype=jnp.float32)
    trained = nnx.state(model, nnx.Param)
    target = nnx.state(out, nnx.Param)
    nnx.update(out, jax.tree.map(lambda t, s: s.astype(t.dtype), target, trained))
    return out


def text(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", "replace")


def check(model: Transformer, offsets, prompt_len: int, new_tokens: int) -> list[dict]:
    """For prompts of `prompt_len` bytes at `offsets` of the training text: greedy continuation, how
    many of its bytes equal the text's own continuation, MTP acceptance, and MTP == plain greedy."""
    data = load_bytes()
    plain_gen = jtilert.Generator(model, max_seq_len=512)
    mtp_gen = jtilert.Generator(model, max_seq_len=512, mtp=True)
    results = []
    for at in offsets:
        prompt = data[at:at + prompt_len]
        plain = plain_gen.generate(prompt, new_tokens)
        spec = mtp_gen.generate(prompt, new_tokens)
        truth = data[at + prompt_len:at + prompt_len + new_tokens]
        n = min(len(plain), len(truth))
        wrong = np.flatnonzero(np.asarray(plain[:n]) != truth[:n])
        same = int(wrong[0]) if wrong.size else n
        print(f"---- prompt at byte {at} " + "-" * 50)
        print(text(prompt))
        print("---- greedy continuation " + "-" * 47)
        print(text(plain))
        print(f"---- {len(plain)} new tokens after a {prompt.size}-token prompt (index_topk {model.cfg.index_topk}, "
              f"compute {jnp.dtype(model.dtype).name}): the first {same} equal the training text; "
              f"MTP acceptance {mtp_gen.acceptance:.3f}, MTP output identical to plain greedy: {spec == plain}")
        results.append({"at": at, "verbatim": same, "acceptance": mtp_gen.acceptance, "identical": spec == plain})
    acc = np.mean([r["acceptance"] for r in results])
    print(f"mean MTP acceptance {acc:.3f}; MTP identical to plain greedy for every prompt: "
          f"{all(r['identical'] for r in results)}")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--long-window", type=int, default=512,
                   help="sequence length of every --long-every-th step (the usable context)")
    p.add_argument("--long-every", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--w-mtp", type=float, default=0.5)
    p.add_argument("--w-kl", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=3e-3)
    p.add_argument("--kl-stride", type=int, default=4, help="indexer loss on every n-th query position")
    p.add_argument("--dense-steps", type=int, default=50, help="dense-attention warm-up steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--fmt", default="bf16", choices=("fp32", "bf16"), help="weight format of the checkpoint")
    p.add_argument("--out", type=Path, default=ASSETS)
    p.add_argument("--check", action="store_true", help="only check the checkpoint at --out")
    p.add_argument("--check-dtype", default=None, choices=("float32", "bfloat16"), help="compute dtype of the check")
    p.add_argument("--prompt-at", type=int, nargs="+", default=[0, 5000, 12000, 20000],
                   help="byte offsets of the check prompts in the text")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=448)
    args = p.parse_args(argv)
    if args.check:
        model = checkpoint.load(args.out, dtype=args.check_dtype)
    else:
        sys.exit("training needs the per-layer model of commit ba89fb0 (see the module docstring); "
                 "--check runs on this one")
    results = check(model, args.prompt_at, args.prompt_len, args.new_tokens)
    if not all(r["identical"] for r in results):
        sys.exit("MTP speculative decoding changed the greedy output")


if __name__ == "__main__":
    main()
