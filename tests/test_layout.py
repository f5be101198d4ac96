"""The folders flax/, tensorflow/ and tokenizers/ share names with packages: they must not shadow them."""

import os

from conftest import ROOT, check_ok, run


def test_package_named_folders_have_no_init():
    for folder in ("flax", "tensorflow", "tokenizers"):
        assert not os.path.exists(os.path.join(ROOT, folder, "__init__.py")), f"{folder}/__init__.py would shadow the package"


def test_imports_resolve_to_site_packages_from_repo_root():
    # `python -c` puts the current directory first on sys.path: the worst case for shadowing.
    code = "import flax, tensorflow, tokenizers; print(flax.__file__); print(tensorflow.__file__); print(tokenizers.__file__)"
    result = check_ok(run(["-c", code], env={"TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=ROOT))
    paths = result.stdout.strip().splitlines()
    assert len(paths) == 3
    for path in paths:
        assert path and "site-packages" in path and not path.startswith(ROOT + os.sep + "flax"), paths
        assert not os.path.abspath(path).startswith(os.path.join(ROOT, "tokenizers")), paths
        assert not os.path.abspath(path).startswith(os.path.join(ROOT, "tensorflow")), paths


# The machinery the four Flax training scripts share: the same text in each (each script is self-contained
# by design), so that a diff of two scripts shows only what differs by objective.
SHARED = ["ModelArguments", "TrainingArguments", "TrainingPlan", "TrainingProgress", "Window", "bf16_dot", "bf16_matmul",
          "_bf16_matmul_fwd", "_bf16_matmul_bwd", "transposes_pay", "written_out_transpose",
          "check_hub_name", "checkpoint_handler", "clear_checkpoints", "create_learning_rate_fn", "decay_mask_fn", "device_batch",
          "epoch_batches", "fail", "fetch_metrics", "find_checkpoint", "generate_batch_splits", "hub_reachable", "init_distributed",
          "list_checkpoints", "log_eval", "log_training", "open_hub_repo", "open_summary_writer", "parse_args", "replicate",
          "release_compiler_memory", "restore_checkpoint", "save_all_but_transcendentals", "save_checkpoint", "save_pretrained", "setup_logging", "step_flops",
          "stop_diverged", "train", "unreplicate", "validate_training_args", "write_json", "write_results", "check_data_file",
          "check_writable", "validate_model_args", "lock_output_dir", "text_column", "check_attention_heads", "cpu_bf16",
          "warn_if_bf16_is_slow"]
PHASES = ["parse_args", "validate_args", "find_checkpoint", "load_raw_datasets", "load_config_and_tokenizer", "resolve_max_seq_length",
          "preprocess", "plan_training", "build_train_state", "make_train_step", "make_eval_step", "train", "evaluate", "write_results"]


def test_flax_training_scripts_share_their_machinery_verbatim():
    import ast

    from conftest import FLAX_TRAINING_SCRIPTS

    texts = {}
    for path in FLAX_TRAINING_SCRIPTS:
        source = open(os.path.join(ROOT, path)).read()
        tree = ast.parse(source)
        defs = {node.name: ast.get_source_segment(source, node) for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert set(PHASES) <= set(defs), (path, set(PHASES) - set(defs))
        main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
        assert main.end_lineno - main.lineno < 120, f"{path}: main() should read as a table of contents"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno <= 80, f"{path}: {node.name} has {node.end_lineno - node.lineno + 1} lines"
        texts[path] = {name: defs[name] for name in SHARED}
    first, *others = texts
    for path in others:
        differing = [name for name in SHARED if texts[path][name] != texts[first][name]]
        assert not differing, f"{path} and {first} differ in {differing}: change all four scripts alike"


def test_every_script_tells_bf16_support_with_the_same_function():
    """cpu_bf16 (what the CPU's flags say of bf16) is one text in every script that needs it, and run_bert_flax.py
    shares the Flax scripts' whole bf16 block."""
    import ast

    def definitions(path):
        source = open(os.path.join(ROOT, path)).read()
        return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}

    mlm = definitions("flax/run_mlm_flax.py")
    for path in ("flax/run_bert_flax.py", "pytorch/run_mlm.py", "tensorflow/run_mlm.py", "benchmarks/run_benchmark.py"):
        assert definitions(path)["cpu_bf16"] == mlm["cpu_bf16"], path
    bert = definitions("flax/run_bert_flax.py")
    for name in ("warn_if_bf16_is_slow", "bf16_dot", "_bf16_matmul_fwd", "_bf16_matmul_bwd", "transposes_pay", "written_out_transpose"):
        assert bert[name] == mlm[name], name
