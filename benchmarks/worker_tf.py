"""The TensorFlow modes (tf.function, with XLA, mixed bf16): transformers' TF RoBERTa, the LM head at the masked
positions (or, in the reference row, everywhere), and tensorflow/run_mlm.py's optimizer (create_optimizer:
AdamWeightDecay, warm-up then linear decay, no decay on LayerNorm and biases)."""

import os

import tensorflow as tf

from benchmarks.measure import step_batch, timed_loop, worker_main
from benchmarks.modes import BETAS, EPS, LEARNING_RATE, MODES, WEIGHT_DECAY, warmup_steps_for


def train(spec, batches):
    from transformers import TFAutoModelForMaskedLM, create_optimizer
    from transformers.modeling_tf_utils import keras

    mode = MODES[spec["mode"]]
    if mode.precision == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = TFAutoModelForMaskedLM.from_pretrained(os.path.join(spec["init_dir"], "tensorflow"))
    total = batches["input_ids"].shape[0]
    optimizer, _ = create_optimizer(
        init_lr=LEARNING_RATE,
        num_train_steps=total,
        num_warmup_steps=warmup_steps_for(total),
        weight_decay_rate=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
    )

    @tf.function(jit_compile=mode.compiled)
    def train_step(input_ids, attention_mask, labels, *positions):
        with tf.GradientTape() as tape:
            if positions:  # the head on the hidden states at the masked positions only
                hidden = model.roberta(input_ids=input_ids, attention_mask=attention_mask, training=True)[0]
                logits = model.lm_head(tf.gather(hidden, positions[0], batch_dims=1))
            else:
                logits = model(input_ids=input_ids, attention_mask=attention_mask, training=True).logits
            mask = labels != -100
            logits = tf.cast(logits, tf.float32)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.where(mask, labels, 0), logits)
            count = tf.maximum(tf.reduce_sum(tf.cast(mask, tf.float32)), 1.0)
            loss = tf.reduce_sum(tf.where(mask, losses, 0.0)) / count
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    names = ("input_ids", "attention_mask", "labels", "masked_positions")

    def run(batch):
        return float(train_step(*(tf.constant(batch[k]) for k in names if k in batch)).numpy())

    times, losses = timed_loop(run, batches, mode.head)
    first = step_batch(batches, 0, mode.head)
    graph = train_step.get_concrete_function(*(tf.constant(first[k]) for k in names if k in first)).graph
    return dict(
        times=times,
        losses=losses,
        num_params=int(model.count_params()),
        versions={"tensorflow": tf.__version__},
        executed_flops=executed_flops(graph),
        executed_by="the step's graph: TensorFlow's registered FLOPs of its matrix products",
    )


def executed_flops(graph):
    """The FLOPs of the matrix products one step's graph (forward, gradients, update) executes, by TensorFlow's own
    per-op statistics (the profiler's registry), counting only products as torch's counter and Flax's do."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.profiler.internal import flops_registry  # noqa: F401  (registers the statistics)
    except ImportError:  # a TensorFlow without the profiler's registry (private modules): the row says "not counted"
        return None

    products = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
    found = [op for op in graph.get_operations() if op.type in products]
    if not found:  # the products traced into a nested function's graph: say so rather than count none
        raise RuntimeError("no matrix product in the train step's own graph")
    return sum(int(ops.get_stats_for_node_def(graph, op.node_def, "flops").value) for op in found)


def matmul_call(precision, a, b):
    dtype = tf.float32 if precision == "fp32" else tf.bfloat16
    x, y = tf.cast(tf.constant(a), dtype), tf.cast(tf.constant(b), dtype)
    return lambda: tf.linalg.matmul(x, y).numpy()


if __name__ == "__main__":
    worker_main(train, matmul_call)
