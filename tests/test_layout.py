"""The folders flax/, tensorflow/ and tokenizers/ share names with packages: they must not shadow them."""

import os
import re

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


def test_the_flax_training_scripts_read_from_main_to_the_machinery():
    """Each of the four Flax training scripts reads in one order: the arguments, the objective block, main() and the
    loop it calls, then the machinery's banner and what main() and the loop call. (No line count: a feature's lines
    are bounded where they are read, by the 80-line functions and the four scripts' one shared text above.)"""
    import ast

    from conftest import FLAX_TRAINING_SCRIPTS

    for path in FLAX_TRAINING_SCRIPTS:
        source = open(os.path.join(ROOT, path)).read()
        lines = source.splitlines()
        banner = next(i for i, line in enumerate(lines) if line.startswith("# === the machinery main() and the loop"))
        defined = {node.name: node.lineno - 1 for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
        block = source[: source.index(BLOCK_END)].count("\n")
        assert block < defined["main"] < defined["train"] < banner, path
        assert all(defined[name] > banner for name in ("fail", "parse_args", "save_checkpoint")), path


def test_the_readme_is_a_map_whose_links_and_paths_resolve():
    """README.md is a map of the repository: every link to a file or heading resolves, every repository path it
    names exists, and every script of the folders a user runs from (flax/, pytorch/, tensorflow/, tokenizers/) is
    named in it. (No line cap: long figures go to benchmarks/README.md, dated ones to benchmarks/LOG.md.)"""
    import re

    def anchors(path):
        text = open(os.path.join(ROOT, path)).read()
        headings = re.findall(r"^#+ (.*)$", text, re.M)
        return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}

    readme = open(os.path.join(ROOT, "README.md")).read()
    results, log = anchors("benchmarks/README.md"), anchors("benchmarks/LOG.md")
    for target, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", readme):
        assert os.path.exists(os.path.join(ROOT, target)), target
        assert not anchor or target != "benchmarks/README.md" or anchor in results, anchor
    for anchor in re.findall(r"\]\(LOG\.md#([^)]+)\)", open(os.path.join(ROOT, "benchmarks", "README.md")).read()):
        assert anchor in log, anchor
    folders = ("flax", "pytorch", "tensorflow", "tokenizers", "benchmarks", "tests")
    named = set(re.findall(rf"\b((?:{'|'.join(folders)})/[\w.-]*\w)(?![\w{{-])", readme))  # not a pattern
    assert len(named) > 20 and all(os.path.exists(os.path.join(ROOT, path)) for path in named), sorted(
        path for path in named if not os.path.exists(os.path.join(ROOT, path))
    )
    for folder in folders[:4]:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            assert not name.endswith(".py") or name in readme, f"README.md does not name {folder}/{name}"


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


def test_the_shared_text_uses_nothing_of_a_block_but_its_table():
    """The loop and the machinery refer to a block's names only through README.md's block table: a block's helpers
    (shifted_token_sums, masked_lm_logits, a collator class, ...) are its own, free to change without reading the
    loop."""
    import ast

    from conftest import FLAX_TRAINING_SCRIPTS

    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("| name | called | gets |") :].split("\n\n")[0]
    contract = {name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    assert {"collate_batch", "loss_sums", "LOSS_TERMS", "DataTrainingArguments"} <= contract, contract
    for path in FLAX_TRAINING_SCRIPTS:
        source = open(os.path.join(ROOT, path)).read()
        first, last = (source[: source.index(marker)].count("\n") + 1 for marker in (BLOCK_START, BLOCK_END))
        tree = ast.parse(source)
        block = {
            name
            for node in tree.body
            if first < node.lineno <= last
            for name in (
                [node.name]
                if hasattr(node, "name")
                else [t.id for t in getattr(node, "targets", []) if hasattr(t, "id")]
            )
        }
        used = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and not first < node.lineno <= last and node.id in block
        }
        assert used <= contract, f"{path}: the shared text uses the block's {sorted(used - contract)}"
