"""Writes the tiny chat fixture beside this file (run it again to regenerate, byte for byte): a
byte-level BPE tokenizer (tokenizer.json) with a ChatML chat template (tokenizer_config.json),
and chat.jsonl, 480 short arithmetic conversations, a third as prompt/completion records. The
fine-tuning guide (docs/guides/fine-tune.md) and the chat tests train on them."""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def conversations(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for number in range(count):
        a, b, word = rng.randint(0, 20), rng.randint(0, 20), rng.choice(sorted(WORDS))
        question, answer = f"What is {a} {word} {b}?", f"{a} {word} {b} is {WORDS[word](a, b)}."
        if number % 3 == 2:
            records.append({"prompt": question, "completion": answer})
        else:
            system = [{"role": "system", "content": "You are a calculator."}] if number % 3 == 1 else []
            user = {"role": "user", "content": question}
            records.append({"messages": [*system, user, {"role": "assistant", "content": answer}]})
    return records


def main() -> None:
    records = conversations(480)
    with (HERE / "chat.jsonl").open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [json.dumps(record) for record in records] + ["You are a calculator. system user assistant"]
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.save(str(HERE / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


if __name__ == "__main__":
    main()
