"""Prompt templates: how a model's prompt is written, stored beside its `config.json` so that training and inference
always render the same prompt.

A prompt for a history of n items (the last `max_items`, oldest first, numbered 1..n) is the text

    prefix + item(1) + separator + item(2) + ... + separator + item(n) + suffix

where item(i) is `item` with `{index}` -> i and `{codes}` -> the item's L code tokens written back to back
(`<a_47><b_103><c_234><d_99>`, named by `code_token`: `{level}` is the level letter a, b, ..., `{level_index}` its
number 0, 1, ..., `{code}` the code). With `bos` the token ids start with the tokenizer's BOS token, as a tokenizer
that adds it itself (Llama's) does: the ids are `[bos] + tokenizer(text, add_special_tokens=False)` (`bos: "auto"`:
where the tokenizer has one, as MiniOneRec's data.py does; Qwen's has none). An `instruction` is text tokenized on its
own before that: the ids are `[bos] + tokenizer(instruction) + tokenizer(text)`, the two parts never merged across
their boundary (MiniOneRec's EvalSidDataset tokenizes its Alpaca instruction and the user input separately).

What the model writes after an item's codes: `answer_suffix` (text, e.g. "\n") and then EOS (`answer_eos`). Their
tokens are forced, one continuation per item, and their log-probabilities count in the item's score (MiniOneRec's
evaluate.py generates codes + "\n" + EOS with length_penalty 0, so its ranking includes them); empty and false, an
item's score is its codes' alone.

Presets: `codes` (the project's own format: `<bos>` + the code tokens of the last 20 items, nothing else), `lcrec`
(the LC-Rec / AtSpeed instruction prompt) and `minionerec` (MiniOneRec's evaluation prompt and ranking). The file
`genrec_template.json` in a model directory holds one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

TEMPLATE_FILE = "genrec_template.json"


@dataclass(frozen=True)
class PromptTemplate:
    name: str = "custom"
    prefix: str = ""  # text before the history
    item: str = "{codes}"  # one history item; `{codes}` once, `{index}` optional
    separator: str = ""  # between two items
    suffix: str = ""  # text after the history
    max_items: int = 20  # the last max_items items of a history are written
    bos: bool | str = True  # the prompt's ids start with the tokenizer's BOS token ("auto": where it has one)
    code_token: str = "<{level}_{code}>"  # the name of the token of (level, code)
    instruction: str = ""  # text before the prefix, tokenized on its own (after BOS)
    answer_suffix: str = ""  # text the model writes after an item's codes: forced, scored
    answer_eos: bool = False  # then EOS: forced, scored

    def __post_init__(self):
        if self.bos not in (True, False, "auto"):
            raise ValueError(f'prompt template {self.name!r}: bos must be true, false or "auto", got {self.bos!r}')
        if not isinstance(self.answer_eos, bool):
            raise ValueError(
                f"prompt template {self.name!r}: answer_eos must be true or false, got {self.answer_eos!r}"
            )
        if self.item.count("{codes}") != 1:
            raise ValueError(
                f"prompt template {self.name!r}: `item` must contain {{codes}} exactly once, got {self.item!r}"
            )
        if not isinstance(self.max_items, int) or self.max_items < 1:
            raise ValueError(
                f"prompt template {self.name!r}: max_items must be an integer >= 1, got {self.max_items!r}"
            )
        if "{code}" not in self.code_token or not ("{level}" in self.code_token or "{level_index}" in self.code_token):
            raise ValueError(
                f"prompt template {self.name!r}: code_token must contain {{code}} and {{level}} or "
                f"{{level_index}}, got {self.code_token!r}"
            )
        try:
            self.item.format(index=1, codes="")
            self.code_token.format(level="a", level_index=0, code=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt template {self.name!r}: bad placeholder in item or code_token ({e!r}); use "
                "{index}, {codes}, {level}, {level_index}, {code}"
            ) from None

    def code(self, level: int, code: int) -> str:
        """(level 0, code 47) -> '<a_47>' by default."""
        if not 0 <= level < 26:
            raise ValueError(f"level must be in [0, 26), got {level}")
        return self.code_token.format(level=chr(ord("a") + level), level_index=level, code=code)

    def text(self, items: list[list[int]]) -> str:
        """The prompt text of a history given as the items' codes [[c_0, .., c_{L-1}], ...] (oldest first); only the
        last max_items are written."""
        items = items[-self.max_items :]
        written = [
            self.item.format(index=i + 1, codes="".join(self.code(j, c) for j, c in enumerate(codes)))
            for i, codes in enumerate(items)
        ]
        return self.instruction + self.prefix + self.separator.join(written) + self.suffix

    def uses_bos(self, tokenizer) -> bool:
        """Do this template's prompts start with the tokenizer's BOS token?"""
        return self.bos is True or (self.bos == "auto" and tokenizer.bos_token_id is not None)

    @property
    def scores_answer(self) -> bool:
        """Does an item's score include forced tokens after its codes (answer_suffix, answer_eos)?"""
        return bool(self.answer_suffix) or self.answer_eos

    def with_max_items(self, max_items: int | None) -> PromptTemplate:
        return self if max_items is None else replace(self, max_items=max_items)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "template") -> PromptTemplate:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: a prompt template is a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{source}: unknown prompt template field(s) {unknown} (known: {sorted(known)})")
        return cls(**raw)


LCREC_PREFIX = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\nThe user has interacted with items "
)
LCREC_SUFFIX = (
    " in chronological order. Can you predict the next possible item that the user may expect?\n\n### Response:"
)
# MiniOneRec (github AkaliKong/MiniOneRec) data.py EvalSidDataset and evaluate.py, as published
MINIONEREC_INSTRUCTION = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request. \n\n### Instruction:\nCan you predict the next possible item "
    "that the user may expect?\n\n"
)
MINIONEREC_PREFIX = (
    "### User Input: \nCan you predict the next possible item the user may expect, given the following chronological "
    "interaction history: "
)
PRESETS = {
    "codes": PromptTemplate(name="codes"),
    "lcrec": PromptTemplate(
        name="lcrec", prefix=LCREC_PREFIX, item="{index}. {codes}", separator=", ", suffix=LCREC_SUFFIX
    ),
    "minionerec": PromptTemplate(
        name="minionerec",
        instruction=MINIONEREC_INSTRUCTION,
        prefix=MINIONEREC_PREFIX,
        separator=", ",
        suffix="\n\n### Response:\n",
        max_items=50,  # their CSVs' histories are written whole (the data's own cap, 10 in the published releases)
        bos="auto",
        answer_suffix="\n",
        answer_eos=True,
    ),
}


def get_template(spec: str | PromptTemplate) -> PromptTemplate:
    """A preset name (`codes`, `lcrec`, `minionerec`), a path to a template JSON file, or a template."""
    if isinstance(spec, PromptTemplate):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_dir():
        return read_template(path)
    if not path.is_file():
        raise ValueError(f"prompt template {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    return _read(path)


def _read(path: Path) -> PromptTemplate:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON prompt template ({e})") from None
    try:
        return PromptTemplate.from_dict(raw, str(path))
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None


def read_template(model_dir) -> PromptTemplate:
    """The prompt template a model directory carries; refused, saying how to add one, when it has none."""
    path = Path(model_dir) / TEMPLATE_FILE
    if not path.is_file():
        raise ValueError(
            f"{model_dir}: no {TEMPLATE_FILE}, so nothing says how this model's prompts are written. Add one with "
            f"`python -m jobs.template --model {model_dir} --preset lcrec` (the LC-Rec instruction prompt; `codes` "
            "for models trained on bare code tokens, or a JSON file of your own), or set models.template in the "
            "nightly config"
        )
    return _read(path)


def write_template(model_dir, template: PromptTemplate) -> Path:
    path = Path(model_dir) / TEMPLATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(template.to_dict(), indent=2) + "\n")
    return path
