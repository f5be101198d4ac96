"""The folders flax/, tensorflow/ and tokenizers/ share names with packages: they must not shadow them."""

import os

from conftest import ROOT, check_ok, run


def test_package_named_folders_have_no_init():
    for folder in ("flax", "tensorflow", "tokenizers"):
        assert not os.path.exists(os.path.join(ROOT, folder, "__init__.py")), (
            f"{folder}/__init__.py would shadow the package"
        )


def test_imports_resolve_to_site_packages_from_repo_root():
    # `python -c` puts the current directory first on sys.path: the worst case for shadowing.
    code = "import flax, tensorflow, tokenizers; "
    code += "print(flax.__file__); print(tensorflow.__file__); print(tokenizers.__file__)"
    result = check_ok(run(["-c", code], env={"TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=ROOT))
    paths = result.stdout.strip().splitlines()
    assert len(paths) == 3
    for path in paths:
        assert path and "site-packages" in path and not path.startswith(ROOT + os.sep + "flax"), paths
        assert not os.path.abspath(path).startswith(os.path.join(ROOT, "tokenizers")), paths
        assert not os.path.abspath(path).startswith(os.path.join(ROOT, "tensorflow")), paths


def test_code_is_formatted_and_linted():
    """ruff format and ruff check, with pyproject.toml's settings (upstream's 119 columns), over the repository."""
    for command in (["format", "--check", "."], ["check", "."]):
        result = run(["-m", "ruff", *command])
        assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout[-3000:]}{result.stderr[-2000:]}"


BLOCK_START, BLOCK_END = "\n# === the objective: ", "\n# === end of the objective ="


def split_script(path):
    """(docstring and header, the shared text outside the objective block, the block) of a Flax training script."""
    source = open(os.path.join(ROOT, path)).read()
    docstring_end = source.index('"""', source.index('"""') + 3) + 3
    start, end = source.index(BLOCK_START), source.index(BLOCK_END)
    return source[:docstring_end], source[docstring_end:start] + source[end:], source[start:end]


def test_flax_training_scripts_differ_only_in_their_objective_block():
    """Everything but the docstring and the objective block is the same text in the four scripts, so that a diff
    of two scripts shows only what differs by objective; main() reads as a table of contents and no function is
    longer than about 80 formatted lines."""
    import ast

    from conftest import FLAX_TRAINING_SCRIPTS

    shared = {}
    for path in FLAX_TRAINING_SCRIPTS:
        source = open(os.path.join(ROOT, path)).read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                length = node.end_lineno - node.lineno + 1
                assert length <= (70 if node.name == "main" else 80), f"{path}: {node.name} has {length} lines"
        _, shared[path], block = split_script(path)
        for name in (
            "MODEL_CLASS",
            "MODEL_TYPES",
            "OBJECTIVE",
            "LENGTH_FLAG",
            "SCORED_TOKENS",
            "LOSS_TERMS",
            "MIN_LENGTH",
            "class DataTrainingArguments",
            "def validate_objective",
            "def fit_objective",
            "def resolve_max_seq_length",
            "def preprocess",
            "def build_collator",
            "def resume_checks",
            "def collate_batch",
            "def build_model",
            "def init_objective_params",
            "def save_model",
            "def loss_sums",
        ):
            assert f"\n{name}" in block, f"{path}: the objective block has no {name}"
    first, *others = FLAX_TRAINING_SCRIPTS
    for path in others:
        assert shared[path] == shared[first], (
            f"{path} and {first} differ outside the objective block: change all four alike"
        )


def test_flax_training_scripts_keep_their_reading_path_and_machinery_short():
    """In each of the four (ruff-formatted) Flax training scripts, the reading path (from the start of the file to
    the machinery's banner: arguments, the objective block with its contract, main() and the loop) is at most 800
    lines, and the machinery (from the banner to the end) at most 1,620: what honest formatting of today's features
    needs (messages wrapped at 119 columns, state in typed objects, nothing squeezed: 683 to 784 and 1,592 lines),
    with room for a fix, not a feature; what a training run does not need lives in the tools beside them
    (flax/train_compile.py, flax/dump_noised_examples.py)."""
    from conftest import FLAX_TRAINING_SCRIPTS

    for path in FLAX_TRAINING_SCRIPTS:
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        banner = next(i for i, line in enumerate(lines) if line.startswith("# === the machinery main() and the loop"))
        assert banner <= 800, f"{path}: the reading path has {banner} lines, more than 800"
        assert len(lines) - banner <= 1620, f"{path}: the machinery has {len(lines) - banner} lines, more than 1,620"


def test_the_readme_is_a_map_of_at_most_230_lines_whose_links_resolve():
    """README.md stays a map (the commands, the layout, one command per script, the block table, headline results):
    at most 230 lines, what its sections need unsqueezed; long figures go to benchmarks/README.md, dated ones to
    benchmarks/LOG.md, and every link to a file or heading there resolves."""
    import re

    def anchors(path):
        text = open(os.path.join(ROOT, path)).read()
        headings = re.findall(r"^#+ (.*)$", text, re.M)
        return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}

    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 230, f"README.md has {len(readme.splitlines())} lines, more than 230"
    results, log = anchors("benchmarks/README.md"), anchors("benchmarks/LOG.md")
    for target, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", readme):
        assert os.path.exists(os.path.join(ROOT, target)), target
        assert not anchor or target != "benchmarks/README.md" or anchor in results, anchor
    for anchor in re.findall(r"\]\(LOG\.md#([^)]+)\)", open(os.path.join(ROOT, "benchmarks", "README.md")).read()):
        assert anchor in log, anchor


def test_every_script_tells_bf16_support_with_the_same_function():
    """cpu_bf16 (what the CPU's flags say of bf16) is one text in every script that needs it, and run_bert_flax.py
    shares the Flax scripts' whole bf16 block."""
    import ast

    def definitions(path):
        source = open(os.path.join(ROOT, path)).read()
        return {
            node.name: ast.get_source_segment(source, node)
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)
        }

    mlm = definitions("flax/run_mlm_flax.py")
    for path in (
        "flax/run_bert_flax.py",
        "pytorch/run_mlm.py",
        "tensorflow/run_mlm.py",
        "benchmarks/workload.py",
    ):
        assert definitions(path)["cpu_bf16"] == mlm["cpu_bf16"], path
    bert = definitions("flax/run_bert_flax.py")
    for name in (
        "warn_if_bf16_is_slow",
        "bf16_dot",
        "_bf16_matmul_fwd",
        "_bf16_matmul_bwd",
        "transposes_pay",
        "written_out_transpose",
    ):
        assert bert[name] == mlm[name], name
