"""The Hugging Face adapter on one process: layers that compose to the model's own forward, meta-device
creation, the loss, and export back to ``from_pretrained``; tiny random configs, no downloads."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, BertForSequenceClassification, LlamaModel

from lightning_bfpp.engine.layers import keep_local_layers, materialize_remaining, pipeline_layers
from lightning_bfpp.engine.pretrained import PretrainedWeightsError, layer_tensors
from lightning_bfpp.engine.tied import find_ties
from lightning_bfpp.integrations.huggingface import (
    CAUSAL_LM_FAMILIES,
    TASK_HEAD_FILE,
    HFCausalLM,
    HFSequenceRegressor,
    causal_lm_layers,
    check_composition,
    encoder_layers,
    export_pretrained,
)
from tests.hf_models import CAUSAL_FAMILIES, ENCODER_FAMILIES, VOCAB, packed_labels, packed_positions, tiny_config

TOL = 1e-5
FAMILIES = CAUSAL_FAMILIES + ENCODER_FAMILIES


def inputs(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    return ids, mask


def hf_model(family: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if family in CAUSAL_FAMILIES else AutoModel
    return auto.from_config(tiny_config(family, **kwargs)).eval()


def hf_output(model, family: str, ids, mask) -> torch.Tensor:
    """What the model's own forward returns: logits, or an encoder's last hidden state."""
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if family in CAUSAL_FAMILIES else out.last_hidden_state


def compose(layers, ids, mask) -> torch.Tensor:
    x = layers[0](ids, mask)
    for layer in layers[1:]:
        x = layer(x)
    return x[0] if isinstance(x, tuple) else x


def module_output(module, family: str, ids, mask) -> torch.Tensor:
    """The module's layers run as the pipeline runs them; an encoder's without its pooling head."""
    layers = module.pipeline_layers()
    return compose(layers if family in CAUSAL_FAMILIES else layers[:-1], ids, mask)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def make_module(family: str, source, **kwargs):
    if family in CAUSAL_FAMILIES:
        return HFCausalLM(source, **kwargs)
    return HFSequenceRegressor(source, **kwargs)


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padding"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_compose_to_the_models_forward(family, padded):
    model = hf_model(family, layers=3)
    ids, mask = inputs(padded)
    with torch.no_grad():
        want = hf_output(model, family, ids, mask)
        layers = causal_lm_layers(model) if family in CAUSAL_FAMILIES else encoder_layers(model)
        got = compose(layers, ids, mask)
        assert_close(got, want)
        # and the LightningModule's forward is that composition, ready for strategy="auto"
        module = make_module(family, model).eval()
        assert_close(module_output(module, family, ids, mask), want)
        if family in CAUSAL_FAMILIES:
            assert_close(module(ids, mask), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_in_one_layer_and_only_tensors_between_layers(family):
    module = make_module(family, tiny_config(family))
    named = pipeline_layers(module)  # the core's checks: every parameter in exactly one layer, no aliases
    assert [n for n, _ in named] == ["embed", "blocks.0", "blocks.1", "head"]
    ids, mask = inputs(padded=True)
    x = module.embed(ids, mask)
    for block in module.blocks:
        assert isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x)
        x = block(x)


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device_creation_materializes_like_a_normal_model(family):
    """Created as `trainer.init_module(empty_init=True)` creates it, materialized as the strategy does: the
    non-persistent buffers (rotary `inv_freq`, BERT's `position_ids`) are right, the weights are initialized
    by the model's own init, and with the same weights the outputs are the normally created model's."""
    torch.manual_seed(0)
    normal = make_module(family, tiny_config(family)).eval()
    with torch.device("meta"):
        meta = make_module(family, tiny_config(family))
    assert all(t.is_meta for t in meta.state_dict().values())
    named = pipeline_layers(meta)
    keep_local_layers(meta, named, [0] * len(named), 0, torch.device("cpu"))
    materialize_remaining(meta, torch.device("cpu"))
    buffers = dict(normal.named_buffers())
    for name, buffer in meta.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    params = dict(meta.named_parameters())
    assert not any(p.is_meta for p in params.values())
    for name, p in params.items():  # the model's init: norms start at one, matrices at std ~0.02
        if "norm" in name.lower() or name.endswith("ln_1.weight"):
            assert torch.all(p == 1) or torch.all(p == 0), name
        elif "embed" in name and p.dim() == 2:
            assert 0.01 < p.std().item() < 0.03, name
    meta.load_state_dict(normal.state_dict())
    meta.eval()
    ids, mask = inputs(padded=True)
    with torch.no_grad():
        assert_close(module_output(meta, family, ids, mask), module_output(normal, family, ids, mask))


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # untied, and tied embeddings (GPT-2)
def test_a_pretrained_folder_is_built_on_meta_and_each_rank_reads_its_own_layers(family, tmp_path):
    """A name or folder builds the model on the meta device; placing a rank's layers reads only their tensors (a
    tied head finds the embedding's), in the dtype asked for, from a sharded folder."""
    model = hf_model(family)
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    module = HFCausalLM(str(tmp_path), dtype="bfloat16")
    assert all(t.is_meta for t in module.state_dict().values())
    assert module.hparams["dtype"] == "bfloat16" and module.pipeline_pretrained is not None
    named = pipeline_layers(module)
    owner = [0] * (len(named) // 2) + [1] * (len(named) - len(named) // 2)  # rank 1: the second half, the head
    local = keep_local_layers(module, named, owner, 1, torch.device("cpu"))
    targets = layer_tensors(local)
    read = module.pipeline_pretrained.fill(targets)
    want = model.state_dict()
    for name, tensor in targets.items():
        hf_name = module._checkpoint_names(name)[0]
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, want[hf_name].to(torch.bfloat16)), name
    stored = {n for name in targets for n in module._checkpoint_names(name)[:1]}
    assert read == sum(want[n].numel() * want[n].element_size() for n in stored)  # those tensors, nothing else
    assert read < sum(t.numel() * t.element_size() for t in want.values())


def test_materialize_reads_the_whole_model_as_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", tie=True))
    model.save_pretrained(tmp_path)
    with torch.device("meta"):  # as `trainer.init_module(empty_init=True)` creates it: nothing is discarded
        module = HFCausalLM(str(tmp_path))
    module.materialize()
    assert module.embed.embed_tokens.weight is module.head.lm_head.weight  # still tied
    assert_same_outputs(AutoModelForCausalLM.from_pretrained(tmp_path), module, "qwen2")


def assert_same_outputs(loaded, module, family: str) -> None:
    """A `transformers` model and a module give the same outputs on a padded batch (both in eval mode)."""
    loaded.eval()
    module.eval()
    ids, mask = inputs(padded=True)
    with torch.no_grad():
        assert_close(hf_output(loaded, family, ids, mask), module_output(module, family, ids, mask))


def test_lora_over_a_pretrained_folder_reads_the_base_weights_and_keeps_the_adapters_init(tmp_path):
    pytest.importorskip("peft")
    model = hf_model("llama")
    model.save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path), lora={"r": 2, "target_modules": ["q_proj", "v_proj"]})
    module.materialize()
    state = module.state_dict()
    base = [n for n in state if ".base_layer." in n]
    assert base and all(torch.equal(state[n], model.state_dict()[module._checkpoint_names(n)[-1]]) for n in base)
    assert all(torch.all(state[n] == 0) for n in state if ".lora_B." in n)  # LoRA's own init: B starts at zero


def test_pretrained_checkpoints_that_cannot_fill_the_layers_are_named(tmp_path):
    model = hf_model("llama")
    bin_folder = tmp_path / "bin"
    model.save_pretrained(bin_folder, safe_serialization=False) if _saves_bin() else _write_bin(model, bin_folder)
    module = HFCausalLM(str(bin_folder))
    with pytest.raises(PretrainedWeightsError, match=r"holds no safetensors file \(pytorch_model\.bin\)"):
        module.materialize()
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(PretrainedWeightsError, match=rf"{shards[-1].name}, which .*index\.json names for `"):
        HFCausalLM(str(sharded)).materialize()
    single = tmp_path / "single"
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1]
    model.config.save_pretrained(single)
    save_file(state, single / "model.safetensors")
    with pytest.raises(
        PretrainedWeightsError, match=r"has no tensor for `head\.norm\.weight` \(as 'model\.norm\.weight'\)"
    ):
        HFCausalLM(str(single)).materialize()
    state["model.norm.weight"] = model.state_dict()["model.norm.weight"]
    save_file(state, single / "model.safetensors")
    with pytest.raises(PretrainedWeightsError, match=r"`model\.layers\.0\.mlp\.up_proj\.weight` in .* has shape"):
        HFCausalLM(str(single)).materialize()


def _saves_bin() -> bool:
    import inspect

    from transformers import PreTrainedModel

    return "safe_serialization" in inspect.signature(PreTrainedModel.save_pretrained).parameters


def _write_bin(model, folder) -> None:
    folder.mkdir()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


def test_a_dropped_layer_is_freed_without_the_garbage_collector():
    """Nothing of the adapter keeps a layer in a reference cycle (each submodule's `reset_parameters` refers to its
    modules weakly; Lightning's hyper-parameter capture is given its frame): a layer the strategy drops (another
    rank's) is freed as soon as it is unreferenced, with the collector off from the model's creation on."""
    import gc
    import weakref

    def keep_first_layer_only(module) -> None:
        named = pipeline_layers(module)
        keep_local_layers(module, named, [0] + [1] * (len(named) - 1), 0, torch.device("cpu"))

    gc.collect()
    gc.disable()
    try:
        module = HFCausalLM(hf_model("llama"))
        refs = [weakref.ref(p) for p in module.blocks[0].parameters()]
        keep_first_layer_only(module)
        assert refs and all(ref() is None for ref in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_causal_loss_is_the_models_own(family):
    model = hf_model(family)
    module = HFCausalLM(model)
    ids, mask = inputs(padded=True)
    labels = ids.masked_fill(mask == 0, -100)
    # the default labels also leave out a token right after padding (predicted from a padding position)
    default = labels.clone()
    default[:, 1:] = default[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=default).loss
        assert_close(module._loss({"input_ids": ids, "attention_mask": mask}), want)
        assert_close(module._loss((ids, mask, labels)), model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_default_labels_do_not_depend_on_how_far_a_batch_is_left_padded():
    """A left-padded sequence's first token would be predicted from a padding position, whose output changes
    with the padding length: one device (one long batch) and the replicas (each padded to its own longest)
    would train on different losses."""
    module = HFCausalLM(hf_model("llama"))
    ids = torch.randint(3, VOCAB, (1, 6))
    short = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    padded = {
        "input_ids": torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], 1),
        "attention_mask": torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], 1),
        "position_ids": torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.arange(6)[None]], 1),
    }
    with torch.no_grad():
        assert_close(module._loss(padded), module._loss(short))


@pytest.mark.parametrize(
    ("num_labels", "pooling"), [(None, "mean"), (3, "cls"), (None, "pooler"), (4, "none"), (None, "none")]
)
def test_regressor_heads_and_losses(num_labels, pooling):
    torch.manual_seed(0)
    module = HFSequenceRegressor(tiny_config("bert"), num_labels=num_labels, pooling=pooling)
    ids, mask = inputs(padded=True)
    out = module(ids, mask)
    width = num_labels or 1
    assert out.shape == ((3, 10, width) if pooling == "none" else (3, width))
    shape = (3, 10) if pooling == "none" else (3,)
    labels = torch.randint(0, width, shape) if num_labels else torch.randn(shape)
    loss = module._loss({"input_ids": ids, "attention_mask": mask, "label": labels})
    assert loss.dim() == 0 and torch.isfinite(loss)
    if pooling == "mean" and num_labels is None:  # sentence-transformers' mean pooling of the hidden states
        hidden = module_output(module, "bert", ids, mask)
        w = mask.unsqueeze(-1).float()
        pred = module.head.classifier((hidden * w).sum(1) / w.sum(1)).squeeze(-1)
        assert_close(loss, torch.nn.functional.mse_loss(pred, labels))


def test_unsupported_models_are_refused_with_what_is_supported():
    torch.manual_seed(0)
    base = LlamaModel(tiny_config("llama"))
    with pytest.raises(TypeError, match=r"`LlamaModel` is not a causal LM with an LM head"):
        HFCausalLM(base)
    with pytest.raises(TypeError, match=r"`BertModel`, `RobertaModel`; got `BertForSequenceClassification`"):
        HFSequenceRegressor(BertForSequenceClassification(tiny_config("bert")))


def small_config(family: str, **kwargs):
    """A tiny config of a family outside the tested list (its own config class, defaults otherwise)."""
    decoder = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    return AutoConfig.for_model(family, **decoder, num_attention_heads=4, **kwargs)


@pytest.mark.parametrize(
    ("family", "kwargs", "message"),
    [
        # positions built in the forward (ALiBi), no rotary module
        ("bloom", {}, r"could not find a rotary embedding \(`rotary_emb`\) in `BloomForCausalLM`"),
        # no `ModuleList` directly under the base model (OPT's layers sit in a decoder submodule)
        ("opt", {"ffn_dim": 64}, r"could not find one `ModuleList` of decoder layers \(found none\)"),
        # state-space / linear-attention layers keep a state besides the hidden states
        ("qwen3_next", {}, r"Layer 0 of this `qwen3_next` model is a `linear_attention` layer"),
        # the router's load-balancing loss spans every stage
        ("mixtral", {"output_router_logits": True}, r"`output_router_logits=True`: its load-balancing loss"),
        # a rotary model whose layers take ALiBi from its forward: found by the composition check (transformers
        # 5.24's layers raise without the ALiBi tensor; 5.25's run and give other logits)
        ("falcon", {"alibi": True}, r"fail where its own forward runs|do not reproduce its logits"),
    ],
)
def test_families_the_generic_path_cannot_take_are_refused_naming_why(family, kwargs, message):
    torch.manual_seed(0)
    with pytest.raises((TypeError, ValueError), match=message):
        HFCausalLM(small_config(family, **kwargs))


@pytest.mark.parametrize("family", ["starcoder2", "phi", "stablelm", "qwen2_moe", "olmoe", "cohere2", "exaone4"])
def test_untested_families_are_taken_after_their_logits_are_checked(family):
    """A family outside `CAUSAL_LM_FAMILIES` with the same structure is checked against its own forward on
    construction (with padding and packed documents) and taken."""
    assert family not in CAUSAL_LM_FAMILIES
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family, num_key_value_heads=2)).eval()
    ids, mask = inputs(padded=True)
    assert_close(compose(causal_lm_layers(model), ids, mask), model(input_ids=ids, attention_mask=mask).logits)


def test_the_composition_check_refuses_layers_that_miss_a_forward_step():
    """Granite's forward multiplies the embeddings and divides the logits outside any module: without that step the
    composition differs, and the check says so."""
    model = hf_model("granite")
    layers = causal_lm_layers(model)
    check_composition(model, layers)
    layers[-1].logits_divisor = None
    with pytest.raises(ValueError, match=r"do not reproduce its logits \(largest difference"):
        check_composition(model, layers)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text", "cohere", "qwen3", "gpt_neox"])
def test_tied_embeddings_of_every_family_stay_one_parameter(family):
    """Families that tie their input and output embeddings (Gemma's and Cohere's default) keep one Parameter."""
    module = HFCausalLM(tiny_config(family, tie=True))
    assert module.head.lm_head.weight is module.embed.embed_tokens.weight
    ids, mask = inputs(padded=True)
    want = hf_model(family, tie=True)(input_ids=ids, attention_mask=mask).logits
    torch.manual_seed(0)
    assert_close(module_output(HFCausalLM(hf_model(family, tie=True)), family, ids, mask), want)


def test_tied_embeddings_stay_one_parameter():
    """GPT-2's default: the head's weight is the embedding's Parameter, in two layers. The core accepts the tie
    and keeps the embedding's name as the canonical one (see lightning_bfpp.engine.tied)."""
    torch.manual_seed(0)
    module = HFCausalLM(tiny_config("gpt2", tie=True))
    assert module.head.lm_head.weight is module.embed.embed_tokens.weight
    named = pipeline_layers(module)
    assert named[0][0] == "embed"
    (group,) = find_ties(module, named)
    assert group.canonical == "embed.embed_tokens.weight" and group.aliases == ("head.lm_head.weight",)


def perturbed(module) -> None:
    """Move every weight, so an export of the initial weights could not pass."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


# every family from the module; the checkpoint kinds (one family per structure) read the same names
EXPORTS = [
    *[(family, "module") for family in (*CAUSAL_FAMILIES, "bert", "gpt2_tied")],
    *[
        (family, source)
        for family in ("gpt2", "llama", "gemma2", "bert", "gpt2_tied")
        for source in ("checkpoint_file", "bfpp_folder")
    ],
]


@pytest.mark.parametrize(("family", "source"), EXPORTS)
def test_export_loads_with_from_pretrained_and_gives_equal_outputs(family, source, tmp_path):
    tie = family == "gpt2_tied"
    family = family.removesuffix("_tied")
    torch.manual_seed(0)
    module = make_module(
        family, tiny_config(family, tie=tie), **({} if family in CAUSAL_FAMILIES else {"num_labels": 3})
    )
    perturbed(module)
    module.eval()
    if source == "module":
        what = module
    elif source == "checkpoint_file":  # one-device, or consolidated: Lightning's checkpoint layout
        what = tmp_path / "model.ckpt"
        torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, what)
    else:  # BFPPStrategy's folder: DCP "model" with the module's names, and meta.pt
        what = tmp_path / "bfpp.ckpt"
        dcp.save({"model": module.state_dict()}, checkpoint_id=what, no_dist=True)
        torch.save({"hyper_parameters": dict(module.hparams)}, what / "meta.pt")
    out = export_pretrained(what, tmp_path / "exported")
    auto = AutoModelForCausalLM if family in CAUSAL_FAMILIES else AutoModel
    loaded = auto.from_pretrained(out).eval()
    ids, mask = inputs(padded=True)
    with torch.no_grad():
        assert_close(hf_output(loaded, family, ids, mask), module_output(module, family, ids, mask))
    if tie:
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    if family in ENCODER_FAMILIES:
        head = torch.load(out / TASK_HEAD_FILE)
        assert head["num_labels"] == 3 and head["pooling"] == "mean"
        assert torch.equal(head["state_dict"]["classifier.weight"], module.head.classifier.weight.detach())


def test_export_from_a_checkpoint_streams_shards_and_never_reads_the_optimizer_state(tmp_path, monkeypatch):
    """From a BFPPStrategy checkpoint folder, each output shard's tensors are read just before it is written, and
    only the model's: the optimizer state is never requested."""
    torch.manual_seed(0)
    module = make_module("llama", tiny_config("llama"))
    perturbed(module)
    what = tmp_path / "bfpp.ckpt"
    optimizer = {f"{name}.exp_avg": torch.randn(t.shape) for name, t in module.state_dict().items()}
    dcp.save({"model": module.state_dict(), "optimizer_0": optimizer}, checkpoint_id=what, no_dist=True)
    torch.save({"hyper_parameters": dict(module.hparams)}, what / "meta.pt")
    requests: list[list[str]] = []
    load = dcp.load
    monkeypatch.setattr(dcp, "load", lambda request, **kw: requests.append(list(request)) or load(request, **kw))
    out = export_pretrained(what, tmp_path / "exported", max_shard_size="20KB")
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists()
    assert len(requests) >= len(shards)  # each shard read in parts as it is written
    assert all(key.startswith("model.") for keys in requests for key in keys)
    largest = max(sum(module.state_dict()[k[len("model.") :]].numel() * 4 for k in keys) for keys in requests)
    biggest = max(t.numel() * 4 for t in module.state_dict().values())
    assert largest <= max(5_000, biggest)  # a quarter shard at a time (one tensor larger than that on its own)
    assert_same_outputs(AutoModelForCausalLM.from_pretrained(out), module, "llama")


def test_load_from_checkpoint_rebuilds_the_module(tmp_path):
    torch.manual_seed(0)
    module = HFCausalLM(tiny_config("qwen2"), lr=3e-3)
    perturbed(module)
    path = tmp_path / "m.ckpt"
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": "2.6",
        },
        path,
    )
    loaded = HFCausalLM.load_from_checkpoint(path).eval()
    ids, mask = inputs(padded=True)
    with torch.no_grad():
        assert_close(loaded(ids, mask), module.eval()(ids, mask))
    assert loaded.hparams.lr == 3e-3


def test_predict_step_returns_the_heads_output_and_pretrained_models_train(tmp_path):
    from transformers import BertConfig, BertModel

    from lightning_bfpp.integrations.huggingface import HFSequenceRegressor

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16)  # fmt: skip
    BertModel(config).save_pretrained(tmp_path / "bert")
    module = HFSequenceRegressor(str(tmp_path / "bert"))
    module.materialize()  # built on the meta device; outside a Trainer the weights are read here
    assert all(m.training for m in module.modules())  # dropout on, as the config asks, though loaded in eval mode
    module.eval()
    ids = torch.randint(0, 50, (3, 6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        assert torch.equal(module.predict_step(batch, 0), module(ids, torch.ones_like(ids)).squeeze(-1))


# -- every batch field the model's forward takes reaches it -------------------------------------------------


def padded_batch() -> dict[str, torch.Tensor]:
    """Right-padded rows of 10, 7 and 4 tokens; labels ignore the padding."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_batch() -> dict[str, torch.Tensor]:
    """Documents packed into rows of 12 as ``DataCollatorWithFlattening`` packs them: ``position_ids`` from 0 at
    each document, labels ``-100`` at each document's first token, no attention mask."""
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    positions = torch.stack([packed_positions(lengths) for lengths in ([4, 5, 3], [6, 6], [2, 7, 1, 2])])
    return {"input_ids": ids, "position_ids": positions, "labels": packed_labels(ids, positions)}


CAUSAL_BATCHES = {
    "padded": padded_batch,
    "packed": packed_batch,
    # transformers separates packed documents only without a mask: with an all-ones one they see each other
    "packed_all_ones_mask": lambda: {**packed_batch(), "attention_mask": torch.ones(3, 12, dtype=torch.long)},
    # GPT-2's forward alone takes token types (embedded with the token embedding)
    "token_types": lambda: {**padded_batch(), "token_type_ids": torch.randint(0, 4, (3, 10))},
}


def hf_reference(model, batch: dict[str, torch.Tensor]):
    """The model's own forward on the batch, without a cache as in training (``transformers``' Trainer sets
    ``use_cache=False``; with a cache, ``transformers`` does not separate packed documents)."""
    return model(**batch, use_cache=False)


@pytest.mark.parametrize("kind", list(CAUSAL_BATCHES))
@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_causal_logits_and_loss_are_the_models_own_for_every_batch_field(family, kind):
    if kind == "token_types" and family != "gpt2":
        pytest.skip("only GPT-2's forward takes token_type_ids")
    model = hf_model(family, layers=3)
    module = HFCausalLM(model).eval()
    batch = CAUSAL_BATCHES[kind]()
    with torch.no_grad():
        want = hf_reference(model, batch)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        assert_close(module(**inputs), want.logits)
        assert_close(module.predict_step(inputs, 0), want.logits)
        assert_close(module._loss(batch), want.loss)
        # the layers as the pipeline runs them, tuple by tuple, on tensors only (torch's pipeline takes no None)
        args = module._model_args(batch)
        assert all(isinstance(a, torch.Tensor) for a in args)
        x = module.embed(*args)
        for block in module.blocks:
            assert all(isinstance(t, torch.Tensor) for t in x)
            x = block(x)
        assert_close(module.head(x), want.logits)


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_packed_documents_do_not_see_each_other(family):
    """The later documents' logits do not change when the first document of their row changes."""
    module = HFCausalLM(hf_model(family, layers=2)).eval()
    batch = packed_batch()
    other = batch["input_ids"].clone()
    other[0, :4] = torch.randint(3, VOCAB, (4,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = module(batch["input_ids"], position_ids=batch["position_ids"])
        changed = module(other, position_ids=batch["position_ids"])
    # equal up to rounding: a mixture of experts groups the tokens by expert, so a batch's matrix shapes and
    # summation order depend on where the other tokens went
    assert (logits[0, 4:] - changed[0, 4:]).abs().max() <= 1e-6
    assert (logits[0, :4] - changed[0, :4]).abs().max() > 1e-2


def encoder_hidden(module, args) -> torch.Tensor:
    """An encoder module's last hidden state, its layers run as the pipeline runs them."""
    x = module.embed(*args)
    for block in module.blocks:
        x = block(x)
    return x[0]


@pytest.mark.parametrize("family", ENCODER_FAMILIES)
def test_encoder_takes_token_types_and_positions(family):
    model = hf_model(family, layers=2)
    module = HFSequenceRegressor(model, num_labels=3, pooling="none").eval()
    batch = padded_batch()
    del batch["labels"]
    g = torch.Generator().manual_seed(4)
    batch["token_type_ids"] = (torch.arange(10) >= 5).long().expand(3, 10)  # a second segment from token 5
    batch["position_ids"] = torch.arange(10).expand(3, 10) + torch.tensor([[0], [3], [9]])
    labels = torch.randint(0, 3, (3, 10), generator=g)
    with torch.no_grad():
        want = hf_reference(model, batch).last_hidden_state
        got = module_output(module, family, *module._model_args(batch)[:2])
        assert not torch.allclose(got, want)  # both fields change the output: the comparison below is not trivial
        assert_close(encoder_hidden(module, module._model_args(batch)), want)
        # positions without token types: the missing input before them is the embeddings' own default
        positions_only = {k: v for k, v in batch.items() if k != "token_type_ids"}
        args = module._model_args(positions_only)
        assert len(args) == 4 and all(isinstance(a, torch.Tensor) for a in args)
        assert_close(encoder_hidden(module, args), hf_reference(model, positions_only).last_hidden_state)
        kept = batch["attention_mask"] != 0
        logits = module.head.classifier(want)
        want_loss = torch.nn.functional.cross_entropy(logits[kept], labels[kept])
        assert_close(module._loss({**batch, "labels": labels}), want_loss)


# -- losses: sums over items, normalised by the strategy over the global batch --------------------------------


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_causal_loss_is_a_sum_over_label_tokens_marked_for_the_global_mean(family):
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lightning_bfpp.engine.loss import item_sum

    module = HFCausalLM(hf_model(family)).eval()
    batch = padded_batch()
    logits = module(batch["input_ids"], batch["attention_mask"])
    loss = module._loss(batch)
    want = ForCausalLMLoss(logits, batch["labels"], vocab_size=VOCAB)
    assert_close(loss.detach(), want.detach())
    parts = item_sum(loss)
    assert parts is not None and int(parts.count) == 6 + 3 + 9  # label tokens after the shift
    assert_close(parts.total.detach(), want.detach() * 18)
    # no label token at all: 0 and no gradient, not NaN
    empty = module._loss({**batch, "labels": torch.full_like(batch["labels"], -100)})
    assert empty.item() == 0.0
    empty.backward()
    assert all(p.grad is None or torch.all(p.grad == 0) for p in module.parameters())


@pytest.mark.parametrize("num_labels", [None, 4])
def test_token_level_regressor_loss_is_a_sum_over_tokens_marked_for_the_global_mean(num_labels):
    from lightning_bfpp.engine.loss import item_sum

    torch.manual_seed(0)
    module = HFSequenceRegressor(tiny_config("bert"), num_labels=num_labels, pooling="none").eval()
    batch = padded_batch()
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 4, (3, 10), generator=g) if num_labels else torch.randn(3, 10, generator=g)
    kept = batch["attention_mask"] != 0
    if num_labels:
        labels[0, 0] = -100  # ignored too
        kept = kept & (labels != -100)
    loss = module._loss({**batch, "labels": labels})
    with torch.no_grad():
        out = module(batch["input_ids"], batch["attention_mask"])
    if num_labels:
        want = torch.nn.functional.cross_entropy(out[kept], labels[kept])
    else:
        want = ((out.squeeze(-1) - labels)[kept] ** 2).mean()
    assert_close(loss.detach(), want)
    parts = item_sum(loss)
    assert parts is not None and int(parts.count) == int(kept.sum())
    empty = torch.zeros_like(batch["attention_mask"])
    assert module._loss({**batch, "attention_mask": empty, "labels": labels}).item() == 0.0


# -- batch fields the layers do not take -------------------------------------------------------------------


def test_fields_the_model_does_not_take_are_ignored_with_a_warning_once():
    import warnings

    module = HFCausalLM(hf_model("llama")).eval()
    batch = padded_batch()
    typo = {**batch, "attention_maks": batch.pop("attention_mask"), "text": ["a", "b", "c"]}
    with torch.no_grad(), pytest.warns(UserWarning, match=r"ignores the batch fields \['attention_maks'\]"):
        module._loss(typo)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        module._loss(typo)  # once per set of fields
        module._loss(padded_batch())  # labels are read by the loss: no warning
        sentences = {k: v for k, v in padded_batch().items() if k != "labels"}
        HFSequenceRegressor(tiny_config("bert"))._loss({**sentences, "label": torch.randn(3)})
    with pytest.warns(UserWarning, match=r"\['token_type_ids'\]: `LlamaForCausalLM.forward` does not take them"):
        module._loss({**padded_batch(), "token_type_ids": torch.zeros(3, 10, dtype=torch.long)})
    with pytest.raises(ValueError, match="takes no `token_type_ids`"):
        module(batch["input_ids"], token_type_ids=torch.zeros(3, 10, dtype=torch.long))


def test_fields_the_pipeline_cannot_pass_are_refused():
    module = HFCausalLM(hf_model("qwen2")).eval()
    batch = padded_batch()
    with pytest.raises(ValueError, match=r"cannot pass \['inputs_embeds'\]"):
        module._loss({**batch, "inputs_embeds": torch.zeros(3, 10, 32)})
    with pytest.raises(ValueError, match="2-D with one column per token"):
        module._loss({**batch, "attention_mask": torch.ones(3, 12, dtype=torch.long)})
    with pytest.raises(ValueError, match="no `input_ids`"):
        module._loss({"attention_mask": batch["attention_mask"]})


# -- LoRA -------------------------------------------------------------------------------------------------

peft = pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def test_lora_freezes_the_base_and_matches_peft_and_exports_an_adapter_and_a_merged_model(tmp_path):
    torch.manual_seed(0)
    module = HFCausalLM(tiny_config("llama"), lora=LORA)
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    optimizer = module.configure_optimizers()
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.parameters() if p.requires_grad
    }
    with torch.no_grad():  # adapters away from B = 0, so that they change the logits; the base as it was drawn
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    ids, mask = inputs(padded=True)
    want = module_output(module, "llama", ids, mask)

    adapter = export_pretrained(module, tmp_path / "adapter")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    loaded = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert_close(loaded(input_ids=ids, attention_mask=mask).logits, want)
    merged = AutoModelForCausalLM.from_pretrained(export_pretrained(module, tmp_path / "merged", merge=True))
    assert not any("lora" in n for n in merged.state_dict())
    assert_close(merged.eval()(input_ids=ids, attention_mask=mask).logits, want)
    with pytest.raises(ValueError, match="merges LoRA adapters; this module has none"):
        export_pretrained(HFCausalLM(tiny_config("llama")), tmp_path / "none", merge=True)


def test_a_peft_model_is_taken_with_its_adapter_name_and_rebuilt_from_its_hyperparameters():
    torch.manual_seed(0)
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_config(tiny_config("qwen3")), peft.LoraConfig(**LORA), adapter_name="mine"
    )
    ids, mask = inputs(padded=True)
    want = model.eval()(input_ids=ids, attention_mask=mask).logits
    module = HFCausalLM(model)
    assert module.hparams["adapter_name"] == "mine" and module.hparams["lora"]["r"] == 4
    assert_close(module_output(module, "qwen3", ids, mask), want)
    rebuilt = HFCausalLM(**module.hparams)
    assert set(rebuilt.state_dict()) == set(module.state_dict())
    with pytest.raises(ValueError, match="not both"):
        HFCausalLM(model, lora=LORA)


def test_lora_layers_made_on_the_meta_device_start_as_peft_starts_them():
    """Materialized from the meta device, B is zero (the adapted model starts as the base model) and A is drawn."""
    with torch.device("meta"):
        module = HFCausalLM(tiny_config("llama"), lora=LORA)
    named = pipeline_layers(module)
    keep_local_layers(module, named, [0] * len(named), 0, torch.device("cpu"))
    materialize_remaining(module, torch.device("cpu"))
    adapters = {n: p for n, p in module.named_parameters() if "lora_" in n}
    assert adapters
    for name, p in adapters.items():
        assert (p == 0).all() == (".lora_B." in name), name


def test_other_peft_methods_and_modules_to_save_are_refused():
    torch.manual_seed(0)
    prompt = peft.get_peft_model(
        AutoModelForCausalLM.from_config(tiny_config("llama")),
        peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
    )
    with pytest.raises(ValueError, match="LoRA is supported"):
        HFCausalLM(prompt)
    with pytest.raises(ValueError, match="`modules_to_save` is not supported"):
        HFCausalLM(tiny_config("llama"), lora={**LORA, "modules_to_save": ["lm_head"]})


def test_lora_on_an_encoder_trains_adapters_and_the_task_head_and_exports_both(tmp_path):
    torch.manual_seed(0)
    module = HFSequenceRegressor(tiny_config("bert"), num_labels=3, lora={**LORA, "target_modules": ["query", "value"]})
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert {n for n in trained if not n.startswith("head.")} and all(
        ".lora_" in n or n.startswith("head.classifier.") for n in trained
    )
    out = export_pretrained(module, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and (out / TASK_HEAD_FILE).is_file()
