"""KerasHub 0.32 task models as parity cases: tiny random configurations built from the public
constructors (no preset, no download), trained on fresh seeded data.

Every model is a KerasHub ``Task``, whose ``fit`` is KerasHub's own (``PipelineModel.fit``: it
builds a ``tf.data.Dataset`` from ``x``, ``y``, ``sample_weight`` and ``batch_size`` and maps
the preprocessor over it), so these cases check that ``tfscale.fit`` and ``tfscale.prepare`` +
``model.fit`` hand that ``fit`` what one device's gets. Dropout is 0 everywhere: the masks of
two replicas are not one device's.

The reference is one device's ``model.fit`` with SGD; with Adam, each sparse gradient (the
token embeddings) is densified before the optimizer (``dense_gradients``), the update tfscale
makes (docs/training.md, "Sparse gradients"; ``sparse_cases.py`` shows where Keras's own
one-device sparse update differs). References run eagerly: a few steps cost less than tracing
them. Weights are compared one variable at a time, the attention key biases left out
(``sparse_cases.variable_differences``: their gradient is exactly zero).

This module imports ``keras_hub``: import it only where KerasHub is installed
(``tests/training/test_kerashub.py`` skips otherwise; ``parity/__init__.py`` does not import it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import keras_hub
import numpy as np
import tensorflow as tf

from .common import SEED, aligned, dense_gradients
from .registry import Case, Check, Run, same_history, same_iterations
from .sparse_cases import same_weights_per_variable, variable_differences

WEIGHTS_RTOL = 1e-5
VOCAB, LENGTH, HIDDEN, EXAMPLES, BATCH, EPOCHS = 96, 8, 16, 32, 8, 2
CLASSES = 3
LORA_RANK = 2

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


# -- data ------------------------------------------------------------------------------------------
def _padded_tokens(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids in 1..VOCAB-1, each sequence zero-padded after a random length (>= 3), and
    its padding mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(EXAMPLES, LENGTH)).astype("int32")
    lengths = rng.integers(3, LENGTH + 1, size=EXAMPLES)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    ids[~mask] = 0
    return aligned(ids), aligned(mask)


def classification_tokens() -> tuple[dict[str, np.ndarray], np.ndarray]:
    """BERT's inputs (token ids, segment ids, padding mask) with labels that depend on them."""
    ids, mask = _padded_tokens(11)
    segments = aligned(np.zeros_like(ids))
    labels = aligned((ids[:, 1:3].sum(axis=1) % CLASSES).astype("int32"))
    return {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}, labels


def next_tokens() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A causal LM's inputs, its labels (the next token) and their weights (0 past the end):
    what KerasHub's ``CausalLMPreprocessor`` makes of a sequence."""
    ids, mask = _padded_tokens(12)
    labels = aligned(np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1))
    weights = aligned(np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1))
    return {"token_ids": ids, "padding_mask": mask}, labels, weights.astype("float32")


def translation_tokens() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A sequence-to-sequence model's inputs (encoder and decoder token ids, their padding
    masks), its labels (the decoder's next token) and their weights (0 past the end): what
    KerasHub's ``Seq2SeqLMPreprocessor`` makes of a pair."""
    encoder, encoder_mask = _padded_tokens(21)
    decoder, decoder_mask = _padded_tokens(22)
    labels = aligned(np.concatenate([decoder[:, 1:], np.zeros_like(decoder[:, :1])], axis=1))
    weights = np.concatenate([decoder_mask[:, 1:], np.zeros_like(decoder_mask[:, :1])], axis=1)
    inputs = {
        "encoder_token_ids": encoder, "encoder_padding_mask": encoder_mask,
        "decoder_token_ids": decoder, "decoder_padding_mask": decoder_mask,
    }  # fmt: skip
    return inputs, labels, aligned(weights).astype("float32")


def masked_tokens() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A masked language model's inputs (two tokens per sequence replaced by the mask token,
    their positions), the original tokens there and their weights (some 0): what KerasHub's
    ``MaskedLMPreprocessor`` makes of a sequence."""
    ids, mask = _padded_tokens(23)
    rng = np.random.default_rng(24)
    positions = (rng.integers(0, 3, size=(EXAMPLES, 2)) + np.array([0, 3])).astype("int32")
    labels = np.take_along_axis(ids, positions, axis=1)
    masked = ids.copy()
    np.put_along_axis(masked, positions, VOCAB - 1, axis=1)
    weights = (rng.random((EXAMPLES, 2)) < 0.8).astype("float32")
    inputs = {
        "token_ids": aligned(masked), "segment_ids": aligned(np.zeros_like(ids)),
        "padding_mask": mask, "mask_positions": aligned(positions),
    }  # fmt: skip
    return inputs, aligned(labels), aligned(weights)


def images() -> tuple[np.ndarray, np.ndarray]:
    """8x8 RGB images with labels that depend on them."""
    rng = np.random.default_rng(13)
    x = rng.normal(size=(EXAMPLES, 8, 8, 3)).astype("float32")
    y = np.argmax(x.reshape(EXAMPLES, -1) @ rng.normal(size=(192, CLASSES)), axis=1)
    return aligned(x), aligned(y.astype("int32"))


WORDS = [f"w{i}" for i in range(40)]
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def sentences() -> tuple[np.ndarray, np.ndarray]:
    """Raw strings of 2 to 9 words of ``WORDS`` (a few unknown ones), labelled by their
    first word."""
    rng = np.random.default_rng(14)
    texts, labels = [], []
    for _ in range(EXAMPLES):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=rng.integers(2, 10))]
        if rng.random() < 0.25:
            words.append("unseen")
        texts.append(" ".join(words))
        labels.append(int(words[0][1:]) % CLASSES)
    return np.array(texts), aligned(np.array(labels, dtype="int32"))


# -- models ----------------------------------------------------------------------------------------
def _compiled(model: Any, optimizer: str, reference: bool, **compile_args: Any) -> Any:
    chosen = OPTIMIZERS[optimizer]()
    if reference and optimizer != "sgd":
        dense_gradients(chosen)
    model.compile(
        optimizer=chosen,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=reference,
        **compile_args,
    )
    return model


# One layer, 2 heads, hidden 16: what every backbone here shares.
TINY: dict[str, Any] = {"num_layers": 1, "hidden_dim": HIDDEN, "intermediate_dim": 2 * HIDDEN}


def bert_backbone(vocabulary_size: int = VOCAB) -> Any:
    """A tiny ``BertBackbone``."""
    return keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary_size,
        num_heads=2,
        dropout=0.0,
        max_sequence_length=LENGTH,
        **TINY,
    )


def bert_classifier(optimizer: str, reference: bool = False) -> Any:
    """``BertTextClassifier`` on token ids (no preprocessor)."""
    keras.utils.set_random_seed(SEED)
    model = keras_hub.models.BertTextClassifier(
        bert_backbone(), num_classes=CLASSES, preprocessor=None, dropout=0.0
    )
    return _compiled(model, optimizer, reference)


def bert_with_preprocessor(optimizer: str, reference: bool = False) -> Any:
    """``BertTextClassifier`` with a ``BertTextClassifierPreprocessor`` (a WordPiece tokenizer
    over ``VOCABULARY``), fed raw strings."""
    keras.utils.set_random_seed(SEED)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCABULARY)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=LENGTH
    )
    model = keras_hub.models.BertTextClassifier(
        bert_backbone(len(VOCABULARY)), num_classes=CLASSES, preprocessor=preprocessor, dropout=0.0
    )
    return _compiled(model, optimizer, reference)


def gpt2(
    optimizer: str, reference: bool = False, lora: bool = False, quantized: bool = False
) -> Any:
    """``GPT2CausalLM`` on token ids (no preprocessor); with ``lora``, its backbone's query
    and value projections fine-tuned by LoRA of rank ``LORA_RANK`` (the rest frozen); with
    ``quantized`` too, QLoRA as KerasHub's Gemma recipe writes it: the model quantized to
    int8 (``model.quantize("int8")``), then LoRA enabled on its backbone."""
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_heads=2, dropout=0.0, max_sequence_length=2 * LENGTH, **TINY
    )
    if lora and not quantized:
        backbone.enable_lora(LORA_RANK)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    if quantized:
        model.quantize("int8")
        model.backbone.enable_lora(LORA_RANK)
    # Greedy sampling: generate() is then a function of the weights alone.
    return _compiled(model, optimizer, reference, sampler="greedy")


def llama3(optimizer: str, reference: bool = False) -> Any:
    """``Llama3CausalLM`` on token ids: 2 query heads sharing 1 key/value head."""
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=1, **TINY
    )
    model = keras_hub.models.Llama3CausalLM(backbone, preprocessor=None)
    return _compiled(model, optimizer, reference, sampler="greedy")


def bart(optimizer: str, reference: bool = False) -> Any:
    """``BartSeq2SeqLM`` on token ids (no preprocessor): an encoder, a decoder attending to it."""
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCAB, num_heads=2, dropout=0.0, max_sequence_length=LENGTH, **TINY
    )
    model = keras_hub.models.BartSeq2SeqLM(backbone, preprocessor=None)
    return _compiled(model, optimizer, reference)


def bert_masked_lm(optimizer: str, reference: bool = False) -> Any:
    """``BertMaskedLM`` on token ids and mask positions (no preprocessor)."""
    keras.utils.set_random_seed(SEED)
    model = keras_hub.models.BertMaskedLM(bert_backbone(), preprocessor=None)
    return _compiled(model, optimizer, reference)


def vit_classifier(optimizer: str, reference: bool = False) -> Any:
    """``ViTImageClassifier`` on 8x8 images in 4x4 patches."""
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3),
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=HIDDEN,
        mlp_dim=2 * HIDDEN,
    )
    model = keras_hub.models.ViTImageClassifier(backbone, num_classes=CLASSES, preprocessor=None)
    return _compiled(model, optimizer, reference)


DETECTION_EXAMPLES = 16


def detection_data() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """32x32 images with one or two boxes each (``yxyx`` pixels; a second box of ``-1`` is
    none): the first half of each batch one box, the second half two, so that the two
    replicas' shares hold different numbers of positive anchors (6 and 31 in the first
    batch)."""
    rng = np.random.default_rng(15)
    x = rng.normal(size=(DETECTION_EXAMPLES, 32, 32, 3)).astype("float32")
    # Boxes of 22-28 pixels: the size of the anchors at pyramid level 3 (smaller ones match
    # no anchor, and an image without a positive anchor is an edge of its own).
    corner = rng.uniform(0, 4, size=(DETECTION_EXAMPLES, 2, 2))
    size = rng.uniform(22, 28, size=(DETECTION_EXAMPLES, 2, 2))
    boxes = np.concatenate([corner, corner + size], axis=-1).astype("float32")
    labels = rng.integers(0, CLASSES, size=(DETECTION_EXAMPLES, 2)).astype("float32")
    for batch in range(0, DETECTION_EXAMPLES, BATCH):
        boxes[batch : batch + BATCH // 2, 1] = -1
        labels[batch : batch + BATCH // 2, 1] = -1
    return aligned(x), {"boxes": aligned(boxes), "labels": aligned(labels)}


class BatchCountRetinaNet(keras_hub.models.RetinaNetObjectDetector):  # type: ignore[misc]
    """KerasHub's RetinaNet with its loss normalized by the positive anchors of the whole
    batch instead of each replica's share's (docs/training.md, "Losses normalized over the
    batch"): KerasHub's loss times this replica's count over the batch's. On one device (no
    strategy, or one replica) the factor is 1."""

    def compute_loss(
        self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None, **kw: Any
    ) -> Any:
        loss = super().compute_loss(x, y, y_pred, sample_weight, **kw)
        _, height, width, _ = keras.ops.shape(x)
        encoded = keras.utils.bounding_boxes.convert_format(
            y,
            source=self.bounding_box_format,
            target=self.label_encoder.bounding_box_format,
            height=height,
            width=width,
        )
        _, labels = self.label_encoder(
            images=x, gt_boxes=encoded["boxes"], gt_classes=encoded["labels"]
        )
        count = keras.ops.sum(keras.ops.cast(keras.ops.greater(labels, -1.0), "float32"))
        # None in cross-replica context: Keras's symbolic build, which only reads shapes.
        context = tf.distribute.get_replica_context()
        total = count if context is None else context.all_reduce("sum", count)
        return loss * keras.ops.maximum(count, 1.0) / keras.ops.maximum(total, 1.0)


def retinanet(reference: bool = False, batch_count: bool = False) -> Any:
    """``RetinaNetObjectDetector`` (or :class:`BatchCountRetinaNet`) on a tiny ResNet whose
    weights are frozen (its BatchNormalization then normalizes with its moving statistics,
    alike on every replica), a feature pyramid of levels 3-4 and one convolution per head;
    SGD at 1e-4 (its untrained loss is in the hundreds)."""
    keras.utils.set_random_seed(SEED)
    encoder = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[7],
        stackwise_num_filters=[64, 8, 8],
        stackwise_num_blocks=[1, 1, 1],
        stackwise_num_strides=[1, 2, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(32, 32, 3),
    )
    encoder.trainable = False
    backbone = keras_hub.models.RetinaNetBackbone(
        image_encoder=encoder, min_level=3, max_level=4, use_p5=False, image_shape=(32, 32, 3)
    )
    kind = BatchCountRetinaNet if batch_count else keras_hub.models.RetinaNetObjectDetector
    model = kind(backbone, num_classes=CLASSES, pre_logits_num_conv_layers=1)
    model.compile(optimizer=keras.optimizers.SGD(1e-4), run_eagerly=reference)
    return model


EXPERTS, TOP_K, AUX_COEFFICIENT = 4, 2, 0.02


def mixtral(optimizer: str, reference: bool = False) -> Any:
    """``MixtralCausalLM`` on token ids: one decoder layer of 4 experts, 2 per token, with a
    load-balancing loss of weight 0.02 (KerasHub's default)."""
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=1, num_experts=EXPERTS,
        top_k=TOP_K, router_aux_loss_coef=AUX_COEFFICIENT, **TINY,
    )  # fmt: skip
    model = keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)
    return _compiled(model, optimizer, reference, weighted_metrics=[])


def qwen3_moe(optimizer: str, reference: bool = False) -> Any:
    """``Qwen3MoeCausalLM`` on token ids: one decoder layer of 4 experts, 2 per token (its
    attention mask, unlike Mixtral's, is the 3-D causal one), load-balancing weight 0.02."""
    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB, num_query_heads=2, num_key_value_heads=1, head_dim=8,
        moe_intermediate_dim=HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
        router_aux_loss_coefficient=AUX_COEFFICIENT, **TINY,
    )  # fmt: skip
    model = keras_hub.models.Qwen3MoeCausalLM(backbone, preprocessor=None)
    return _compiled(model, optimizer, reference, weighted_metrics=[])


# -- checks ----------------------------------------------------------------------------------------
def lora_only(expected: Run, got: Run) -> None:
    """LoRA trained what it leaves trainable and nothing else: every ``lora_kernel_b`` (zeros
    at the start) moved, every frozen weight (the kernels LoRA adapts, the rest of the
    backbone) is its initial value. (Keras's ``enable_lora`` freezes a layer's kernel, not its
    bias.)"""
    start = dict(zip([v.path for v in got.model.weights], got.initial_weights, strict=True))
    changed = {v.path for v in got.model.weights if not np.array_equal(v.numpy(), start[v.path])}
    lora_b = {v.path for v in got.model.weights if v.path.endswith("lora_kernel_b")}
    assert lora_b and lora_b <= changed, f"not trained: {sorted(lora_b - changed)}"
    frozen = sorted(changed - {v.path for v in got.model.trainable_weights})
    assert not frozen, f"frozen weights changed: {frozen}"


PROMPT_LENGTH = 3


def prompts() -> dict[str, np.ndarray]:
    """4 prompts of ``PROMPT_LENGTH`` tokens, padded to ``LENGTH`` (what ``generate`` fills)."""
    x, _, _ = next_tokens()
    ids = x["token_ids"][:4].copy()
    mask = np.zeros_like(ids, dtype=bool)
    mask[:, :PROMPT_LENGTH] = True
    ids[~mask] = 0
    return {"token_ids": ids, "padding_mask": mask}


def generated(model: Any) -> np.ndarray:
    """The token ids ``model.generate`` continues ``prompts()`` with (to ``LENGTH``),
    checked to keep the prompts and to fill every position."""
    given = prompts()
    tokens = model.generate(given, stop_token_ids=None)
    assert tokens["token_ids"].shape == given["token_ids"].shape
    kept = tokens["token_ids"][:, :PROMPT_LENGTH]
    np.testing.assert_array_equal(kept, given["token_ids"][:, :PROMPT_LENGTH])
    assert tokens["padding_mask"].all(), "generate stopped before max_length"
    return np.asarray(tokens["token_ids"])


def generates_as_reference(expected: Run, got: Run) -> None:
    """After the fit, ``generate`` continues the same prompts to the same tokens as the
    reference's model (greedy sampling)."""
    np.testing.assert_array_equal(generated(got.model), generated(expected.model))


# -- cases -----------------------------------------------------------------------------------------
def _fit(inputs: Callable[[], tuple[Any, ...]]) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        data = inputs()
        arguments = {"x": data[0], "y": data[1], "batch_size": BATCH, "epochs": EPOCHS}
        if len(data) > 2:
            arguments["sample_weight"] = data[2]
        return arguments

    return make


SOURCE = "KerasHub 0.32 keras_hub.models.{} (tiny random configuration)"


def _case(
    name: str,
    model: str,
    build: Callable[..., Any],
    inputs: Callable[[], tuple[Any, ...]],
    optimizer: str,
    extra_checks: tuple[Check, ...] = (),
) -> Case:
    rtol, why = ROUNDING.get(f"{name}_{optimizer}", (WEIGHTS_RTOL, None))
    return Case(
        f"{name}_{optimizer}",
        SOURCE.format(model),
        lambda: build(optimizer),
        _fit(inputs),
        reference_build=lambda: build(optimizer, reference=True),
        checks=[same_weights_per_variable(rtol), same_history(), same_iterations, *extra_checks],
        weights_rtol=rtol,
        known_difference=why,
    )


# Cases whose weights one device cannot reproduce to WEIGHTS_RTOL itself.
ROUNDING = {
    "bert_classifier_adam": (
        1e-4,
        "the classifier reads the [CLS] output only, so most token rows get gradients of "
        "~5e-6 from sums of ~1e-2 terms (cancellation) and Adam's normalisation scales their "
        "rounding up: one device's own graph and eager fits differ by 1.6e-5 there",
    ),
    "vit_classifier_adam": (
        5e-5,
        "the batch's gradient summed from two halves rounds differently, and Adam's "
        "normalisation scales that up in the MLP's output kernel: on an Intel Xeon host one "
        "device accumulating the two half-batches' gradients (Keras's "
        "gradient_accumulation_steps=2) differs from its own full-batch fit by 1.36e-5 there, "
        "2 replicas by 1.33e-5 (an AMD EPYC host: both under 1e-5); 5e-5 leaves that 3.7x",
    ),
    "qwen3_moe_global_adam": (
        1e-4,
        "Adam's normalisation scales up the rounding of small gradients: one device's own "
        "graph and eager fits of this model differ by 1.2e-5 (the query kernel), 2 replicas "
        "by 4e-5 (the token embedding); with SGD 2 replicas are 3e-7 from one device",
    ),
}


def _gpt2_lora(optimizer: str, reference: bool = False) -> Any:
    return gpt2(optimizer, reference, lora=True)


def _gpt2_qlora(optimizer: str, reference: bool = False) -> Any:
    return gpt2(optimizer, reference, lora=True, quantized=True)


CASES = [
    case
    for optimizer in OPTIMIZERS
    for case in (
        _case(
            "bert_classifier",
            "BertTextClassifier",
            bert_classifier,
            classification_tokens,
            optimizer,
        ),
        _case("gpt2_causal_lm", "GPT2CausalLM", gpt2, next_tokens, optimizer),
        _case("llama3_causal_lm", "Llama3CausalLM", llama3, next_tokens, optimizer),
        _case("vit_classifier", "ViTImageClassifier", vit_classifier, images, optimizer),
        _case("bart_seq2seq_lm", "BartSeq2SeqLM", bart, translation_tokens, optimizer),
        _case("bert_masked_lm", "BertMaskedLM", bert_masked_lm, masked_tokens, optimizer),
        _case(
            "bert_preprocessor_strings",
            "BertTextClassifier + BertTextClassifierPreprocessor",
            bert_with_preprocessor,
            sentences,
            optimizer,
        ),
        _case(
            "gpt2_lora_generate",
            "GPT2CausalLM (backbone.enable_lora) + generate",
            _gpt2_lora,
            next_tokens,
            optimizer,
            (lora_only, generates_as_reference),
        ),
        _case(
            "gpt2_qlora",
            "GPT2CausalLM (quantize int8, then backbone.enable_lora)",
            _gpt2_qlora,
            next_tokens,
            optimizer,
            (lora_only,),
        ),
    )
]


# -- mixture of experts: a load-balancing loss over the batch's tokens ---------------------------
UNEVEN_BATCH = 7  # split 4 + 3 over 2 replicas (the last batch of 4: 2 + 2)


def _moe_fit() -> dict[str, Any]:
    arguments = _fit(next_tokens)()
    arguments["batch_size"] = UNEVEN_BATCH
    return arguments


def balanced_per_replica(expected: Run, got: Run) -> None:
    """Each replica balances the experts over its own share of the tokens (KerasHub's loss
    is a product of two means over the batch it is given): the weights differ from one
    device's, as under Keras's own fit (docs/training.md, "Mixture of experts")."""
    differences = variable_differences(got.model, expected.model)
    worst = max(differences.values())
    assert worst > 1e-3, f"per-replica load balancing gave one device's weights ({worst:.3g})"


def _moe_case(
    name: str, model: str, build: Callable[..., Any], optimizer: str, global_batch: bool
) -> Case:
    if global_batch:
        rtol, why = ROUNDING.get(f"{name}_global_{optimizer}", (WEIGHTS_RTOL, None))
        return Case(
            f"{name}_global_{optimizer}",
            f"{SOURCE.format(model)}, global_load_balancing=True",
            lambda: build(optimizer),
            _moe_fit,
            options={"global_load_balancing": True},
            reference_build=lambda: build(optimizer, reference=True),
            checks=[same_weights_per_variable(rtol), same_history(), same_iterations],
            weights_rtol=rtol,
            known_difference=why,
        )
    return Case(
        f"{name}_per_replica_{optimizer}",
        SOURCE.format(model),
        lambda: build(optimizer),
        _moe_fit,
        reference_build=lambda: build(optimizer, reference=True),
        checks=[balanced_per_replica, same_iterations],
        known_difference=(
            "each replica's load-balancing loss is over its own share of the batch's tokens "
            "(docs/training.md, 'Mixture of experts')"
        ),
    )


MOE_CASES = [
    _moe_case("mixtral", "MixtralCausalLM", mixtral, "sgd", global_batch=True),
    _moe_case("qwen3_moe", "Qwen3MoeCausalLM", qwen3_moe, "adam", global_batch=True),
    _moe_case("mixtral", "MixtralCausalLM", mixtral, "sgd", global_batch=False),
]


# -- a loss normalized over the batch --------------------------------------------------------------
def update_norm(run: Run) -> float:
    """The norm of everything the run's fit moved."""
    moved = zip(run.model.get_weights(), run.initial_weights, strict=True)
    return float(np.sqrt(sum(np.sum((np.float64(a) - b) ** 2) for a, b in moved)))


def larger_update_than_one_device(expected: Run, got: Run) -> None:
    """Each replica divides the sum of its share's losses by its own positive anchors (about
    half the batch's on 2 replicas), so the update is larger than one device's (about twice,
    as under Keras's own fit) and the weights far from it: the difference docs/training.md
    states ("Losses normalized over the batch")."""
    from tfscale.testing import relative_difference

    ratio = update_norm(got) / update_norm(expected)
    difference = relative_difference(got.model.get_weights(), expected.model.get_weights())
    assert ratio > 1.5 and difference > 0.5, (ratio, difference)


DETECTION_SOURCE = SOURCE.format("RetinaNetObjectDetector")

DETECTION_CASES = [
    Case(
        "retinanet_own_normalizer_sgd",
        DETECTION_SOURCE,
        retinanet,
        _fit(detection_data),
        reference_build=lambda: retinanet(reference=True),
        checks=[larger_update_than_one_device, same_iterations],
        known_difference=(
            "KerasHub divides the loss by the positive anchors of the batch each replica "
            "sees, not the whole batch's (docs/training.md, 'Losses normalized over the batch')"
        ),
    ),
    Case(
        "retinanet_batch_count_sgd",
        f"{DETECTION_SOURCE}, normalized by the batch's count (BatchCountRetinaNet)",
        lambda: retinanet(batch_count=True),
        _fit(detection_data),
        reference_build=lambda: retinanet(reference=True, batch_count=True),
        # The heads' own losses in History are KerasHub's, each replica's normalized by its count.
        checks=[
            same_weights_per_variable(WEIGHTS_RTOL),
            same_history(skip=("bbox_regression_loss", "cls_logits_loss")),
            same_iterations,
        ],
    ),
]
