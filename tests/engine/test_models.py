"""Every architecture against HF transformers (float32, CPU, torch attention backend)."""

from __future__ import annotations

import pytest
import torch

from paged_engine.attention import get_attention_backend
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.loader import load_hf_config, load_model, resolve_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ATOL = 1e-4

# (arch, config overrides): every code path of each architecture at least once
CASES = [
    ("llama", {}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        },
    ),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("opt", {}),
    ("opt", {"word_embed_proj_dim": 32, "do_layer_norm_before": False}),
    ("gpt2", {}),
    ("gpt_neox", {}),
    ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 1.0}),
]
IDS = [f"{a}-{'-'.join(o) or 'default'}" for a, o in CASES]


class PagedRunner:
    """Our model plus a tiny paged KV cache; sequences get disjoint consecutive blocks."""

    def __init__(self, model: torch.nn.Module, max_blocks_per_seq: int = 24):
        attn = [m for m in model.modules() if isinstance(m, Attention)]
        self.model = model
        self.kv_caches = [
            tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, a.num_kv_heads, a.head_dim) for _ in "kv")
            for a in attn
        ]
        self.max_blocks = max_blocks_per_seq
        self.backend = get_attention_backend("torch", torch.device("cpu"))

    def block_table(self, seq: int) -> list[int]:
        first = 1 + seq * self.max_blocks  # block 0 is the null block
        return list(range(first, first + self.max_blocks))

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """chunks: (seq index, new token ids, start position). Returns logits [T, V]."""
        ids, pos, slots, cu, lens, tables = [], [], [], [0], [], []
        for seq, tokens, start in chunks:
            table = self.block_table(seq)
            for j, tok in enumerate(tokens):
                p = start + j
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            cu.append(cu[-1] + len(tokens))
            lens.append(start + len(tokens))
            tables.append(table)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            max_seqlen_q=max(len(c[1]) for c in chunks),
            max_seqlen_k=max(lens),
            backend=self.backend,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv_caches, md)
        return self.model.compute_logits(hidden)


def load_ours(path) -> torch.nn.Module:
    resolved = resolve_model(str(path))
    config = load_hf_config(resolved)
    return load_model(resolved, config, dtype=torch.float32, device="cpu")


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()


def load_hf(path):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except TypeError:  # older transformers
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 512, (n,), generator=gen).tolist()


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def pair(request, tiny_model_factory):
    arch, overrides = request.param
    path = tiny_model_factory(arch, **overrides)
    return load_ours(path), load_hf(path)


def test_prefill_matches_hf(pair):
    ours, hf = pair
    tokens = prompt(37, seed=1)
    got = PagedRunner(ours).step([(0, tokens, 0)])
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_match_hf(pair):
    ours, hf = pair
    tokens = prompt(30, seed=2)
    want = hf_logits(hf, tokens)
    runner = PagedRunner(ours)
    got = [runner.step([(0, tokens[:13], 0)]), runner.step([(0, tokens[13:27], 13)])]
    got += [runner.step([(0, [t], 27 + i)]) for i, t in enumerate(tokens[27:])]
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_batch_of_two_sequences_matches_hf(pair):
    ours, hf = pair
    a, b = prompt(21, seed=3), prompt(9, seed=4)
    runner = PagedRunner(ours)
    got = runner.step([(0, a, 0), (1, b, 0)])
    torch.testing.assert_close(got[:21], hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[21:], hf_logits(hf, b), atol=ATOL, rtol=0)
    # mixed step: one decode row and one prefill continuation in the same forward
    got = runner.step([(1, [7], 9), (0, [8, 9, 10], 21)])
    torch.testing.assert_close(got[:1], hf_logits(hf, [*b, 7])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1:], hf_logits(hf, [*a, 8, 9, 10])[-3:], atol=ATOL, rtol=0)


def test_padding_slots_are_skipped(tiny_llama_dir):
    model = load_ours(tiny_llama_dir)
    runner = PagedRunner(model)
    tokens = prompt(6, seed=5)
    want = runner.step([(0, tokens, 0)])
    before = [c.clone() for kv in runner.kv_caches for c in kv]
    # Same tokens again into seq 1, plus a padding token whose slot is -1.
    runner2 = PagedRunner(model)
    for dst, src in zip([c for kv in runner2.kv_caches for c in kv], before):
        dst.copy_(src)
    ids = torch.tensor([*tokens, 3])
    positions = torch.tensor([*range(6), 0])
    table = runner2.block_table(1)
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(6)] + [-1]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([table], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        max_seqlen_q=6,
        max_seqlen_k=6,
        backend=get_attention_backend("torch", torch.device("cpu")),
    )
    with torch.no_grad():
        got = model.compute_logits(model(ids, positions, runner2.kv_caches, md)[:6])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # seq 0's blocks untouched by the padding token
    for kv_after, kv_before in zip([c for kv in runner2.kv_caches for c in kv], before):
        first = runner2.block_table(0)
        torch.testing.assert_close(kv_after[first], kv_before[first])


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("mistral", {"sliding_window": 8}), ("qwen3", {}), ("gpt_neox", {})],
)
def test_triton_backend_matches_torch_backend(tiny_model_factory, arch, overrides):
    """The Triton kernels (interpreted on CPU) behind the same layer give the same logits."""
    pytest.importorskip("triton")
    model = load_ours(tiny_model_factory(arch, **overrides))
    tokens = prompt(19, seed=6)
    runs = {}
    for backend in ("torch", "triton"):
        runner = PagedRunner(model)
        runner.backend = get_attention_backend(backend, torch.device("cpu"))
        first = runner.step([(0, tokens[:12], 0), (1, tokens[:5], 0)])
        second = runner.step([(0, tokens[12:], 12), (1, [tokens[5]], 5)])
        runs[backend] = torch.cat([first, second])
    torch.testing.assert_close(runs["triton"], runs["torch"], atol=2e-4, rtol=0)


@torch.no_grad()
def test_linear_weight_loaders_shard_for_tensor_parallelism():
    """Per-rank shards reassemble the full layer: column outputs concatenate, row outputs sum."""
    from paged_engine.layers.embedding import ParallelLMHead
    from paged_engine.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    w, b = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    cols = [ColumnParallelLinear(16, 8, tp_rank=r, tp_size=2) for r in range(2)]
    for layer in cols:
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    torch.testing.assert_close(torch.cat([m(x) for m in cols], -1), x @ w.T + b)

    wr = torch.randn(4, 16, generator=gen)
    rows = [RowParallelLinear(16, 4, tp_rank=r, tp_size=2) for r in range(2)]
    for layer in rows:
        layer.weight.weight_loader(layer.weight, wr)
        layer.bias.weight_loader(layer.bias, b[:4])
    parts = [m(x[:, 8 * r : 8 * r + 8]) for r, m in enumerate(rows)]
    torch.testing.assert_close(sum(parts), x @ wr.T + b[:4])

    gate, up = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    merged = [
        MergedColumnParallelLinear(16, [6, 6], bias=False, tp_rank=r, tp_size=2) for r in range(2)
    ]
    for layer in merged:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
    out = [m(x) for m in merged]  # rank r: [gate_r | up_r]
    torch.testing.assert_close(torch.cat([o[:, :3] for o in out], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([o[:, 3:] for o in out], -1), x @ up.T)

    # 4 query heads, 2 kv heads, head_dim 2; tp 4 replicates each kv head on two ranks
    wq, wk, wv = (torch.randn(n, 16, generator=gen) for n in (8, 4, 4))
    for tp in (2, 4):
        qkv = [QKVParallelLinear(16, 2, 4, 2, bias=False, tp_rank=r, tp_size=tp) for r in range(tp)]
        for layer in qkv:
            for shard, t in zip("qkv", (wq, wk, wv)):
                layer.weight.weight_loader(layer.weight, t, shard)
        q_local = 8 // tp  # rows; every rank holds one kv head (2 rows each of k and v)
        for r, layer in enumerate(qkv):
            q, k, v = layer.weight.split([q_local, 2, 2])
            kv_rank = r // (tp // 2)
            torch.testing.assert_close(q, wq[r * q_local : (r + 1) * q_local])
            torch.testing.assert_close(k, wk[kv_rank * 2 : kv_rank * 2 + 2])
            torch.testing.assert_close(v, wv[kv_rank * 2 : kv_rank * 2 + 2])

    emb = torch.randn(10, 4, generator=gen)  # vocab 10 over 4 ranks: shards of 3, last padded
    heads = [ParallelLMHead(10, 4, tp_rank=r, tp_size=4) for r in range(4)]
    for head in heads:
        head.weight.weight_loader(head.weight, emb)
    h = torch.randn(2, 4, generator=gen)
    torch.testing.assert_close(torch.cat([m(h) for m in heads], -1)[:, :10], h @ emb.T)
