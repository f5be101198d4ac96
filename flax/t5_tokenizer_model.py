#!/usr/bin/env python
# Reproduction of Hugging Face's examples/flax/language-modeling/t5_tokenizer_model.py (Apache-2.0
# upstream), working on tokenizers 0.22.
"""The SentencePiece-Unigram tokenizer of the README's T5 example, built with `tokenizers`.

NMT + NFKC normalisation, runs of spaces collapsed, lowercase; Metaspace, individual digits and
punctuation pre-tokenisers; pad=0, eos=1, unk=2; `</s>` appended to every sequence.

Upstream passes `add_prefix_space` to `Metaspace`, which tokenizers >= 0.19 rejects
(`Metaspace.__new__() got an unexpected keyword argument 'add_prefix_space'`); its successor is
`prepend_scheme` ("always" is what add_prefix_space=True meant).

Use it from Python, or through `tokenizers/train_tokenizer.py --tokenizer_type unigram`:
  from t5_tokenizer_model import SentencePieceUnigramTokenizer
  tokenizer = SentencePieceUnigramTokenizer(unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
  tokenizer.train_from_iterator(lines, vocab_size=32000)
  tokenizer.save("tokenizer.json")
"""

import json
from collections.abc import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.implementations.base_tokenizer import BaseTokenizer
from tokenizers.models import Unigram
from tokenizers.processors import TemplateProcessing


class SentencePieceUnigramTokenizer(BaseTokenizer):
    def __init__(
        self,
        replacement: str = "▁",
        add_prefix_space: bool = True,
        unk_token: str | AddedToken = "<unk>",
        eos_token: str | AddedToken = "</s>",
        pad_token: str | AddedToken = "<pad>",
    ):
        self.special_tokens = {
            "pad": {"id": 0, "token": pad_token},
            "eos": {"id": 1, "token": eos_token},
            "unk": {"id": 2, "token": unk_token},
        }
        self.special_tokens_list = [None] * len(self.special_tokens)
        for token_dict in self.special_tokens.values():
            self.special_tokens_list[token_dict["id"]] = token_dict["token"]

        prepend_scheme = "always" if add_prefix_space else "never"
        tokenizer = Tokenizer(Unigram())
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " "), normalizers.Lowercase()]
        )
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Metaspace(replacement=replacement, prepend_scheme=prepend_scheme),
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.Punctuation(),
            ]
        )
        tokenizer.decoder = decoders.Metaspace(replacement=replacement, prepend_scheme=prepend_scheme)
        tokenizer.post_processor = TemplateProcessing(
            single=f"$A {self.special_tokens['eos']['token']}",
            special_tokens=[(self.special_tokens["eos"]["token"], self.special_tokens["eos"]["id"])],
        )
        parameters = {
            "model": "SentencePieceUnigram",
            "replacement": replacement,
            "add_prefix_space": add_prefix_space,
        }
        super().__init__(tokenizer, parameters)

    def train(self, files: str | list[str], vocab_size: int = 8000, show_progress: bool = True):
        """Train the model using the given files"""
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=self.special_tokens_list, show_progress=show_progress
        )
        if isinstance(files, str):
            files = [files]
        self._tokenizer.train(files, trainer=trainer)
        self.add_unk_id()

    def train_from_iterator(
        self,
        iterator: Iterator[str] | Iterator[Iterator[str]],
        vocab_size: int = 8000,
        show_progress: bool = True,
        length=None,
    ):
        """Train the model using the given iterator"""
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=self.special_tokens_list, show_progress=show_progress
        )
        self._tokenizer.train_from_iterator(iterator, trainer=trainer, length=length)
        self.add_unk_id()

    def add_unk_id(self):
        tokenizer_json = json.loads(self._tokenizer.to_str())
        tokenizer_json["model"]["unk_id"] = self.special_tokens["unk"]["id"]
        self._tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json))
