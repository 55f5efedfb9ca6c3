"""Memory-centric tiling (infinity/tiling/): tiled layers against their dense
equivalents, and tile_model on a small GPT-like model against a deepcopy of it
trained by plain PyTorch."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infinity.tiling import (
    TiledEmbedding,
    TiledLinear,
    TiledTiedHead,
    TilingPlan,
    split_ranges,
    tile_model,
)

EXACT = {"rtol": 0.0, "atol": 0.0}


def tile_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}


def dense_grad(tiled: nn.Module, which: str = "weight") -> torch.Tensor:
    (tensor,) = [t for t in tiled.tensor_map() if t.name == which]
    return tensor.assemble(tile_grads(tiled))


# --------------------------------------------------------------------------- TiledLinear


def test_split_ranges_match_tensor_split():
    for size, splits in [(10, 3), (7, 7), (64, 5), (1, 1), (100, 1)]:
        sizes = [stop - start for start, stop in split_ranges(size, splits)]
        assert sizes == [len(c) for c in torch.arange(size).tensor_split(splits)]
        assert split_ranges(size, splits)[-1][1] == size


@pytest.mark.parametrize(
    "in_features, out_features, in_splits, out_splits, bias",
    [
        (12, 20, 1, 1, True),
        (12, 20, 1, 3, True),  # uneven: 7, 7, 6
        (13, 20, 4, 1, True),  # uneven columns
        (13, 23, 3, 5, True),
        (13, 23, 3, 5, False),
        (8, 5, 8, 5, True),  # one element per tile
    ],
)
def test_tiled_linear_matches_linear(in_features, out_features, in_splits, out_splits, bias):
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=bias)
    tiled = TiledLinear.from_dense(dense, in_splits=in_splits, out_splits=out_splits)
    assert len(tiled.tile_modules()) == in_splits * out_splits

    x = torch.randn(2, 3, in_features)  # leading batch dims
    x_dense = x.clone().requires_grad_()
    x_tiled = x.clone().requires_grad_()
    y_dense, y_tiled = dense(x_dense), tiled(x_tiled)
    # One tile is the same F.linear call. Otherwise equal up to fp32 rounding:
    # the matmul kernel may depend on the tile's width, and partial sums over
    # input columns are added in a different order.
    single = in_splits == 1 and out_splits == 1
    torch.testing.assert_close(y_tiled, y_dense, **(EXACT if single else {}))

    grad_out = torch.randn_like(y_dense)
    y_dense.backward(grad_out)
    y_tiled.backward(grad_out)
    torch.testing.assert_close(x_tiled.grad, x_dense.grad)
    torch.testing.assert_close(dense_grad(tiled, "weight"), dense.weight.grad)
    if bias:
        torch.testing.assert_close(dense_grad(tiled, "bias"), dense.bias.grad)
    else:
        assert all(t.bias is None for t in tiled.tile_modules())


def test_tiled_linear_bias_only_in_first_column_tile():
    tiled = TiledLinear(6, 4, bias=True, in_splits=3, out_splits=2)
    for row in tiled.tiles:
        assert [t.bias is not None for t in row] == [True, False, False]


def test_tiled_linear_bf16():
    torch.manual_seed(0)
    dense = nn.Linear(64, 48)
    x = torch.randn(4, 64)
    reference = dense(x)  # fp32
    tiled = TiledLinear.from_dense(dense.to(torch.bfloat16), in_splits=4, out_splits=3)
    y = tiled(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference, rtol=2e-2, atol=3e-2)
    y.float().sum().backward()
    assert all(t.weight.grad.dtype == torch.bfloat16 for t in tiled.tile_modules())


def test_tiled_linear_from_dense_copies_and_to_dense_reassembles():
    dense = nn.Linear(10, 9)
    tiled = TiledLinear.from_dense(dense, in_splits=2, out_splits=3)
    back = tiled.to_dense()
    torch.testing.assert_close(back.weight, dense.weight, **EXACT)
    torch.testing.assert_close(back.bias, dense.bias, **EXACT)
    with torch.no_grad():
        dense.weight.zero_()
        dense.bias.zero_()
    assert all(t.weight.abs().sum() > 0 for t in tiled.tile_modules())  # no aliasing
    assert back.weight.abs().sum() > 0


def test_tiled_linear_init_bounds():
    tiled = TiledLinear(100, 30, in_splits=3, out_splits=2)
    bound = 100**-0.5
    for tile in tiled.tile_modules():
        assert tile.weight.abs().max() <= bound
        if tile.bias is not None:
            assert tile.bias.abs().max() <= bound


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"in_splits": 0}, "in_splits"),
        ({"out_splits": 0}, "out_splits"),
        ({"in_splits": 9}, "in_splits"),
        ({"out_splits": 5}, "out_splits"),
        ({"out_splits": 1.5}, "out_splits"),
    ],
)
def test_tiled_linear_rejects_bad_splits(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        TiledLinear(8, 4, **kwargs)


def test_tiled_layers_explain_missing_weight():
    with pytest.raises(AttributeError, match="split into tiles"):
        TiledLinear(4, 4, out_splits=2).weight
    with pytest.raises(AttributeError, match="split into tiles"):
        TiledEmbedding(10, 4, splits=2).weight
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        TiledLinear(4, 4).nonexistent


# --------------------------------------------------------------------------- embedding and tied head


@pytest.mark.parametrize("splits, padding_idx", [(1, None), (3, None), (4, 5), (7, -1)])
def test_tiled_embedding_and_tied_head_match_dense(splits, padding_idx):
    torch.manual_seed(0)
    dense = nn.Embedding(23, 6, padding_idx=padding_idx)
    tiled = TiledEmbedding.from_dense(dense, splits=splits)
    head = tiled.as_head()
    assert all(h.weight is e.weight for h, e in zip(head.tiles, tiled.tiles))  # tied tile by tile

    ids = torch.randint(0, 23, (3, 17))
    ids[0, :3] = torch.tensor([0, 22, dense.padding_idx if padding_idx is not None else 1])
    x_dense, x_tiled = dense(ids), tiled(ids)
    torch.testing.assert_close(x_tiled, x_dense, **EXACT)

    h = torch.randn(3, 17, 6)
    logits_dense = F.linear(h, dense.weight)  # the tied head
    logits_tiled = head(h)
    torch.testing.assert_close(logits_tiled, logits_dense, **(EXACT if splits == 1 else {}))

    grad_x, grad_logits = torch.randn_like(x_dense), torch.randn_like(logits_dense)
    torch.autograd.backward([x_dense, logits_dense], [grad_x, grad_logits])
    torch.autograd.backward([x_tiled, logits_tiled], [grad_x, grad_logits])
    # The tied weight's gradient is the sum of both uses (padding row: head only).
    torch.testing.assert_close(dense_grad(tiled), dense.weight.grad)
    only_embedding = torch.zeros_like(dense.weight).index_add_(0, ids.flatten(), grad_x.reshape(-1, 6))
    assert not torch.allclose(dense.weight.grad, only_embedding)


def test_tiled_embedding_from_dense_copies_and_to_dense_reassembles():
    dense = nn.Embedding(11, 3, padding_idx=4)
    tiled = TiledEmbedding.from_dense(dense, splits=3)
    back = tiled.to_dense()
    assert back.padding_idx == 4
    torch.testing.assert_close(back.weight, dense.weight, **EXACT)
    with torch.no_grad():
        dense.weight.fill_(7.0)
    assert not torch.equal(tiled.to_dense().weight, dense.weight)


def test_tiled_embedding_padding_row_zero_and_no_grad():
    tiled = TiledEmbedding(10, 3, splits=3, padding_idx=5)
    torch.testing.assert_close(tiled(torch.tensor([5])), torch.zeros(1, 3), **EXACT)
    tiled(torch.tensor([5, 5, 6])).sum().backward()
    grad = dense_grad(tiled)
    assert torch.equal(grad[5], torch.zeros(3)) and torch.equal(grad[6], torch.ones(3))


def test_tiled_embedding_rejects_out_of_range_ids_and_bad_splits():
    tiled = TiledEmbedding(10, 3, splits=2)
    with pytest.raises(IndexError, match="10"):
        tiled(torch.tensor([1, 10]))
    with pytest.raises(IndexError, match="-1"):
        tiled(torch.tensor([-1]))
    with pytest.raises(ValueError, match="splits"):
        TiledEmbedding(10, 3, splits=11)
    with pytest.raises(ValueError, match="padding_idx"):
        TiledEmbedding(10, 3, padding_idx=10)
    with pytest.raises(ValueError, match="max_norm"):
        TiledEmbedding.from_dense(nn.Embedding(10, 3, max_norm=1.0), splits=2)


def test_tied_head_with_bias_from_dense():
    torch.manual_seed(0)
    emb = nn.Embedding(9, 4)
    lin = nn.Linear(4, 9)
    lin.weight = emb.weight
    tiled_emb = TiledEmbedding.from_dense(emb, splits=2)
    head = TiledTiedHead.from_dense(lin, tiled_emb)
    x = torch.randn(5, 4)
    torch.testing.assert_close(head(x), lin(x))
    torch.testing.assert_close(head.to_dense().bias, lin.bias, **EXACT)
    with pytest.raises(ValueError, match="shape"):
        TiledTiedHead.from_dense(nn.Linear(4, 8), tiled_emb)


# --------------------------------------------------------------------------- tile_model


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc_in = nn.Linear(dim, hidden)  # the wide MLP
        self.fc_out = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc_out(F.gelu(self.fc_in(self.ln(x))))


class ToyGPT(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(8, dim)  # tiled only at the smaller limit
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[-1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# 300: rows split only (wte 3 tiles, fc_in 4, fc_out 4); 40: fc_out's 64 input
# columns are over the limit, so its columns are split too.
@pytest.mark.parametrize("max_tile_numel", [300, 40])
def test_tile_model_trains_like_the_dense_model(max_tile_numel):
    torch.manual_seed(0)
    dense = ToyGPT()
    tiled = copy.deepcopy(dense)
    plan = tile_model(tiled, max_tile_numel)

    assert isinstance(tiled.wte, TiledEmbedding) and isinstance(tiled.lm_head, TiledTiedHead)
    assert isinstance(tiled.blocks[0].fc_in, TiledLinear) and isinstance(tiled.blocks[1].fc_out, TiledLinear)
    assert type(tiled.wpe) is (nn.Embedding if max_tile_numel == 300 else TiledEmbedding)
    assert all(h.weight is e.weight for h, e in zip(tiled.lm_head.tiles, tiled.wte.tiles))
    assert plan.tensors["lm_head.weight"].tied_to == "wte.weight"
    if max_tile_numel == 40:
        assert tiled.blocks[0].fc_out.in_splits == 2
    # No module owns a parameter over the limit directly, and the containers own none.
    for module in tiled.modules():
        for p in module.parameters(recurse=False):
            assert p.numel() <= max(max_tile_numel, 16), type(module).__name__
    assert list(tiled.wte.parameters(recurse=False)) == []

    # The same state, under the dense names and shapes, in the same order.
    untiled = plan.untile_state_dict(tiled.state_dict())
    reference = dense.state_dict()
    assert list(untiled) == list(reference)
    for name in reference:
        torch.testing.assert_close(untiled[name], reference[name], **EXACT)

    ids = torch.randint(0, 50, (4, 8))
    torch.testing.assert_close(tiled(ids), dense(ids))

    opt_dense = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    opt_tiled = torch.optim.AdamW(tiled.parameters(), lr=1e-2)
    for step in range(3):
        batch = torch.randint(0, 50, (4, 8))
        for model, opt in [(dense, opt_dense), (tiled, opt_tiled)]:
            opt.zero_grad()
            loss_of(model, batch).backward()
        if step == 0:  # gradients mapped back through the plan
            grads = plan.untile_state_dict(tile_grads(tiled))
            reference_grads = tile_grads(dense)
            assert set(grads) == set(reference_grads)
            for name in reference_grads:
                torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-5, atol=1e-6)
        opt_dense.step()
        opt_tiled.step()

    untiled = plan.untile_state_dict(tiled.state_dict())
    for name, value in dense.state_dict().items():
        torch.testing.assert_close(untiled[name], value, rtol=1e-5, atol=1e-6)


def test_every_tile_is_called_so_the_engine_fetches_one_at_a_time():
    model = ToyGPT()
    tile_model(model, 300)
    called = []
    for module in model.modules():
        if list(module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, args: called.append(m))
    loss_of(model, torch.randint(0, 50, (2, 8))).backward()
    owners = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert {id(m) for m in owners} <= {id(m) for m in called}
    for m in owners:  # every parameter has a gradient through its own module
        assert all(p.grad is not None for p in m.parameters(recurse=False))


def test_state_dict_round_trip_and_loading_a_dense_checkpoint():
    torch.manual_seed(0)
    dense = ToyGPT()
    tiled = copy.deepcopy(dense)
    plan = tile_model(tiled, 40)
    with torch.no_grad():
        for p in tiled.parameters():
            p.zero_()

    dense_sd = dense.state_dict()
    tiled_sd = plan.tile_state_dict(dense_sd)
    assert set(tiled_sd) == set(tiled.state_dict())
    tiled.load_state_dict(tiled_sd, strict=True)
    ids = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(tiled(ids), dense(ids))

    back = plan.untile_state_dict(tiled_sd)
    assert list(back) == list(dense_sd)
    for name in dense_sd:
        torch.testing.assert_close(back[name], dense_sd[name], **EXACT)
    # split() copies: the tile tensors never share the dense tensor's storage.
    assert tiled_sd["wte.tiles.0.weight"].untyped_storage().data_ptr() != dense_sd["wte.weight"].data_ptr()

    # Tensor by tensor (what a streaming writer uses).
    entry = plan.tensors["blocks.0.fc_out.weight"]
    assert entry.shape == (16, 64) and plan.dense_name_of(entry.tiles[0].name) == entry.name
    torch.testing.assert_close(entry.assemble(entry.split(dense_sd[entry.name])), dense_sd[entry.name], **EXACT)


def test_untile_state_dict_partial_inputs():
    model = ToyGPT()
    plan = tile_model(model, 300)
    sd = model.state_dict()
    # named_parameters() lists a tied tensor once: the head's entry is left out.
    from_params = plan.untile_state_dict(dict(model.named_parameters()))
    assert "wte.weight" in from_params and "lm_head.weight" not in from_params
    del sd["blocks.0.fc_in.tiles.1.0.weight"]
    with pytest.raises(KeyError, match=r"blocks\.0\.fc_in\.weight.*tiles\.1\.0\.weight"):
        plan.untile_state_dict(sd)


def test_untouched_model_gives_an_empty_plan():
    model = ToyGPT()
    before = model.state_dict()
    plan = tile_model(model, 10**6)
    assert plan.is_empty and isinstance(plan, TilingPlan) and "empty" in repr(plan)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    assert plan.untile_state_dict(after) == after and plan.tile_state_dict(after) == after


def test_tile_model_on_meta_device():
    with torch.device("meta"):
        model = ToyGPT()
    plan = tile_model(model, 40)
    assert all(p.is_meta for p in model.parameters())
    assert all(h.weight is e.weight for h, e in zip(model.lm_head.tiles, model.wte.tiles))
    reference_plan = tile_model(ToyGPT(), 40)
    assert plan.tensors == reference_plan.tensors
    untiled = plan.untile_state_dict(model.state_dict())
    assert {k: tuple(v.shape) for k, v in untiled.items()} == {
        k: tuple(v.shape) for k, v in ToyGPT().state_dict().items()
    }


def test_tile_model_split_choice():
    model = nn.Sequential(nn.Linear(100, 1000), nn.Linear(1000, 7), nn.Embedding(1000, 30))
    plan = tile_model(model, 999)
    wide, deep, emb = model
    assert (wide.out_splits, wide.in_splits) == (112, 1)  # 9 rows of 100 per tile
    assert (deep.out_splits, deep.in_splits) == (7, 2)  # rows over the limit: columns split too
    assert emb.splits == 31  # 33 rows of 30 per tile
    for tensor in plan.tensors.values():
        if len(tensor.shape) == 2:
            assert max(t.shape[0] * t.shape[1] for t in tensor.tiles) <= 999
    with pytest.raises(ValueError, match="max_tile_numel"):
        tile_model(nn.Sequential(nn.Embedding(100, 64)), 32)
    with pytest.raises(ValueError, match="max_tile_numel"):
        tile_model(model, 0)
    with pytest.raises(ValueError, match="the model itself"):
        tile_model(nn.Linear(10, 10), 50)


def test_ties_tiling_cannot_keep_are_left_untiled(caplog):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight  # Linear tied to Linear
            self.emb = nn.Embedding(10, 8, max_norm=1.0)  # untileable embedding...
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight  # ...and its tied head

    model = TwoHeads()
    with caplog.at_level(logging.WARNING, logger="infinity.tiling"):
        plan = tile_model(model, 16)
    assert plan.is_empty
    assert all(type(m) in (nn.Linear, nn.Embedding) for m in (model.a, model.b, model.emb, model.head))
    assert "left untiled" in caplog.text and "max_norm" in caplog.text


def test_linear_subclasses_and_shared_modules():
    shared = nn.Linear(8, 32)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(16, 2), "x": shared, "y": shared})
    plan = tile_model(model, 100)
    assert type(model["attn"].out_proj) is not TiledLinear  # a subclass: read by its parent, left alone
    assert isinstance(model["x"], TiledLinear) and model["x"] is model["y"]
    assert {"x.weight", "y.weight", "x.bias", "y.bias"} <= set(plan.tensors)
    q = torch.randn(3, 1, 16)
    model["attn"](q, q, q)


# --------------------------------------------------------------------------- subclasses and init on meta


class RowIndexLinear(nn.Linear):
    """A subclass that changes only the init, and whose init depends on the
    full shape: weight[r, c] = r * in_features + c, bias[r] = -r."""

    @torch.no_grad()
    def reset_parameters(self):
        self.weight.copy_(torch.arange(self.weight.numel(), dtype=self.weight.dtype).view_as(self.weight))
        if self.bias is not None:
            self.bias.copy_(-torch.arange(self.out_features, dtype=self.bias.dtype))


class RowIndexEmbedding(nn.Embedding):
    """GPT-style tying by calling the embedding again (as infinity.models.gpt does)."""

    tiling_compatible = True

    @torch.no_grad()
    def reset_parameters(self):
        self.weight.copy_(torch.arange(self.weight.numel(), dtype=self.weight.dtype).view_as(self.weight) / 100)

    def forward(self, x, unembed=False):
        return F.linear(x, self.weight) if unembed else super().forward(x)


class UnembedGPT(nn.Module):
    def __init__(self, vocab=30, dim=8):
        super().__init__()
        self.wte = RowIndexEmbedding(vocab, dim)
        self.fc = RowIndexLinear(dim, 3 * dim)
        self.plain = nn.Linear(3 * dim, dim)
        self.pad = nn.Embedding(vocab, dim, padding_idx=7)

    def forward(self, ids):
        x = self.wte(ids) + self.pad(ids)
        x = self.plain(torch.tanh(self.fc(x)) / 100)
        return self.wte(x, unembed=True)


def materialize(model: nn.Module) -> dict[int, torch.Tensor]:
    """What the engine does with a meta model: for each module owning parameters,
    in order, give them real stand-ins and call its reset_parameters(); a shared
    parameter takes the values of its first owner. Returns id(param) -> values."""
    values: dict[int, torch.Tensor] = {}
    for module in model.modules():
        params = {k: p for k, p in module._parameters.items() if p is not None}
        if not params:
            continue
        stand_ins = {k: nn.Parameter(torch.empty(p.shape)) for k, p in params.items()}
        module._parameters.update(stand_ins)
        with torch.no_grad():
            module.reset_parameters()
        module._parameters.update(params)
        for k, p in params.items():
            values.setdefault(id(p), stand_ins[k].detach())
    return values


def test_tiles_initialize_like_the_dense_layer_on_meta():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = UnembedGPT()
    plan = tile_model(model, 20)  # plain's 24 input columns are split too
    assert isinstance(model.wte, TiledEmbedding) and isinstance(model.fc, TiledLinear)
    assert isinstance(model.plain, TiledLinear) and isinstance(model.pad, TiledEmbedding)
    values = materialize(model)
    state = {n: values[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    dense = plan.untile_state_dict(state)

    reference = UnembedGPT()  # real device: the subclasses' deterministic inits
    torch.testing.assert_close(dense["wte.weight"], reference.wte.weight.detach(), **EXACT)
    torch.testing.assert_close(dense["fc.weight"], reference.fc.weight.detach(), **EXACT)
    torch.testing.assert_close(dense["fc.bias"], reference.fc.bias.detach(), **EXACT)
    # Stock inits: the same distribution, drawn tile by tile.
    bound = 24**-0.5  # nn.Linear(24, 8): from the full in_features, though its columns are split
    assert model.plain.in_splits > 1
    assert dense["plain.weight"].abs().max() <= bound and dense["plain.weight"].abs().max() > 0.8 * bound
    assert torch.equal(dense["pad.weight"][7], torch.zeros(8))
    assert 0.7 < dense["pad.weight"].std() < 1.3


def test_tied_head_tile_initializes_the_shared_weight_like_the_embedding():
    with torch.device("meta"):
        emb = RowIndexEmbedding(10, 4)
    head = TiledEmbedding.from_dense(emb, splits=3).as_head(bias=True)
    values = materialize(head)  # the head alone, before its embedding
    (weight_map, bias_map) = head.tensor_map()
    state = {n: values[id(p)] for n, p in head.named_parameters()}
    torch.testing.assert_close(weight_map.assemble(state), RowIndexEmbedding(10, 4).weight.detach(), **EXACT)
    assert bias_map.assemble(state).abs().max() <= 0.5  # nn.Linear(4, 10)'s bias bound


def test_subclass_called_again_as_the_tied_head_matches_dense():
    torch.manual_seed(0)
    dense = UnembedGPT()
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_()
    tiled = copy.deepcopy(dense)
    plan = tile_model(tiled, 50)
    ids = torch.randint(0, 30, (3, 5))
    torch.testing.assert_close(tiled(ids), dense(ids))
    tiled(ids).square().mean().backward()
    dense(ids).square().mean().backward()
    grads = plan.untile_state_dict(tile_grads(tiled))
    for name, grad in tile_grads(dense).items():
        torch.testing.assert_close(grads[name], grad)


def test_subclasses_with_their_own_forward_are_left_untiled(caplog):
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Unembed(RowIndexEmbedding):
        tiling_compatible = False

    model = nn.Sequential(Scaled(8, 8), Unembed(10, 8))
    with caplog.at_level(logging.WARNING, logger="infinity.tiling"):
        plan = tile_model(model, 16)
    assert plan.is_empty and type(model[0]) is Scaled and type(model[1]) is Unembed
    assert "overrides forward" in caplog.text and "tiling_compatible" in caplog.text


def test_tiled_model_deepcopies_with_its_ties():
    model = ToyGPT()
    tile_model(model, 300)
    clone = copy.deepcopy(model)
    assert all(h.weight is e.weight for h, e in zip(clone.lm_head.tiles, clone.wte.tiles))
    assert clone.wte.tiles[0].weight is not model.wte.tiles[0].weight
    clone.reset_parameters = None  # the tiles still reset on their own
    clone.blocks[0].fc_in.reset_parameters()
    ids = torch.randint(0, 50, (2, 8))
    assert not torch.equal(clone(ids), model(ids))
