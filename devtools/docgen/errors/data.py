"""Troubleshooting entries of the section "Data"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Data"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "torch-cp-bidirectional-row-length",
        SECTION,
        "cp_backend: torch with causal: false, and a row whose length does not split over the ranks",
        "cp_backend: torch with causal: false cannot split row 0 of the prepared training data: its 5 tokens "
        "are not a multiple of context_parallel_size=2",
        "torch's context-parallel attention takes no padding mask, so every row must split evenly as it is. "
        "Use `cp_backend: ring-flash-attn` (it masks padding), or samples whose lengths are multiples of "
        "`context_parallel_size`. Checked on the prepared data before launching (and by `cptune preprocess`).",
    ),
    Entry(
        "torch-cp-bidirectional-mixed-lengths",
        SECTION,
        "cp_backend: torch with causal: false, micro_batch_size > 1 and rows of different lengths",
        "cp_backend: torch with causal: false and micro_batch_size: 2 would pad rows of different lengths in "
        "one batch",
        "Rows of one batch are padded to the longest, which torch's attention cannot mask. Use "
        "`micro_batch_size: 1` (with more `gradient_accumulation_steps`), or `cp_backend: ring-flash-attn`. "
        "Checked on the prepared data before launching (and by `cptune preprocess`).",
    ),
    Entry(
        "data-path-missing",
        SECTION,
        "A dataset path that does not exist",
        "missing.jsonl' does not exist (relative paths are read from",
        "Fix the path (relative paths are read from the folder you run cptune in), or give a hub "
        "dataset id such as `owner/name`.",
    ),
    Entry(
        "data-folder-without-files",
        SECTION,
        "A dataset folder without data files",
        "the folder holds no data files (.json, .jsonl, .ndjson, .csv, .tsv, .parquet, .arrow, and",
        "Point the dataset at a data file, or at a folder holding files of the listed types.",
    ),
    Entry(
        "data-file-empty",
        SECTION,
        "An empty data file",
        "the data files are empty. Point datasets[0].path at data with rows.",
        "Point the dataset at a file with rows.",
    ),
    Entry(
        "data-not-json",
        SECTION,
        "A JSONL file with a broken line",
        "could not load it as local data",
        "The message quotes the reader's error; fix the line it names (every line of a .jsonl file is "
        "one JSON object).",
    ),
    Entry(
        "data-not-json-validate",
        SECTION,
        "cptune validate: a JSONL file with a broken line",
        "broken.jsonl), row 1 (line 2): not valid JSON (Expecting property name enclosed in double quotes, "
        "column 2). Each line of a JSON lines file must be one JSON object; fix the line.",
        "`cptune validate` reads the first 10 rows of each local data file and names the row and the line "
        "that does not parse, with the recipe's other problems. Fix that line.",
    ),
    Entry(
        "data-first-rows-without-column",
        SECTION,
        "cptune validate: the first rows of a data file lack a column their type needs",
        "columns.jsonl): its first 2 rows have no column 'output' (they have 'answer', 'instruction')",
        "The dataset's `type` reads its columns by name (alpaca: instruction, input, output). Set the field "
        "name keys of the entry (e.g. `field_output: answer`) to the columns the data uses, or give the "
        "entry the type of its rows.",
    ),
    Entry(
        "data-not-utf8",
        SECTION,
        "A data file that is not UTF-8",
        "latin1.jsonl' is not UTF-8 text (line 2).",
        "JSON, JSON lines, CSV and TSV files must be UTF-8. Convert the file (e.g. "
        "`iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`) or fix the bytes on the line shown.",
    ),
    Entry(
        "data-unsupported-file",
        SECTION,
        "A data file of a type cptune cannot read",
        "cannot read files of type .txt",
        "Convert the data to one of the listed formats (JSON lines, JSON, CSV, TSV, Parquet, Arrow; the text "
        "formats may be compressed: .gz, .zst, .bz2, .xz).",
    ),
    Entry(
        "data-column-missing",
        SECTION,
        "A field name that no row has",
        "no column 'answer' (it has 'instruction', 'input', 'output'). Set the field name keys of "
        "datasets[0]",
        "Set the dataset's field keys (`field_output`, `field_messages`, `field`, ...) to the columns "
        "your data uses; the message lists them.",
    ),
    Entry(
        "data-row-field-missing",
        SECTION,
        "A row without a required field",
        "missing.jsonl), row 1: field 'output' is missing.",
        "The message names the dataset, the row (counted from 0) and the field. Fix the row, or set "
        "`skip_invalid_rows: true` to skip such rows (they are counted and reported).",
    ),
    Entry(
        "data-row-wrong-type",
        SECTION,
        "A row whose field has the wrong type",
        "row 0: field 'output' is a int, not text.",
        "Make the field text (quote numbers in JSON), or skip such rows with `skip_invalid_rows: true`.",
    ),
    Entry(
        "data-row-empty-field",
        SECTION,
        "A row whose answer is empty",
        "row 2: field 'output' is empty.",
        "A row with nothing to train on is a mistake in the data; fix it or skip such rows.",
    ),
    Entry(
        "chat-no-assistant-turn",
        SECTION,
        "A chat row without an assistant turn",
        "row 2: no message with a role in roles_to_train ['assistant']",
        "Every chat row needs a turn to train on. Fix the row, set `roles_to_train` for the dataset, or "
        "skip such rows with `skip_invalid_rows: true`.",
    ),
    Entry(
        "chat-messages-not-a-list",
        SECTION,
        "A chat row whose messages are not a list",
        "row 1: field 'messages' is not a non-empty list of messages.",
        "`messages` holds a list of `{role, content}` turns. Fix the row, or skip such rows with "
        "`skip_invalid_rows: true`.",
    ),
    Entry(
        "chat-system-message-only",
        SECTION,
        "A chat row left empty by drop_system_message",
        "row 1: field 'messages' holds a system message only, which drop_system_message leaves out",
        "With `drop_system_message: true` a conversation's first system message is left out, and this row had "
        "nothing else. Fix the row, set `drop_system_message: false` for the dataset, or skip such rows with "
        "`skip_invalid_rows: true`.",
    ),
    Entry(
        "chat-unknown-role",
        SECTION,
        "A chat row with a role the chat template does not know",
        "row 0: the chat template rejected the messages (Unknown role narrator",
        "The tokenizer's chat template refused the row; its own message follows. Map the data's roles to the "
        "template's with the dataset's `roles` (e.g. `{user: [narrator]}`; `human` and `gpt` are mapped to "
        "`user` and `assistant` by default, as in Axolotl), or skip such rows with `skip_invalid_rows: true`.",
    ),
    Entry(
        "chat-no-template",
        SECTION,
        "A chat dataset with a tokenizer that has no chat template",
        "has type chat_template, but the tokenizer has no chat template",
        "Set `chat_template: chatml` to use cptune's ChatML template, or use a tokenizer that ships one.",
    ),
    Entry(
        "data-all-too-long",
        SECTION,
        "Every sample is longer than sequence_len",
        "no sample is left of its 600 rows (600 longer than sequence_len",
        "Samples longer than `sequence_len` are dropped (and counted in the data statistics); when none "
        "is left, raise `sequence_len` or set `excess_length_strategy: truncate`.",
    ),
    Entry(
        "val-set-too-large",
        SECTION,
        "val_set_size takes every training sample",
        "val_set_size: 1000.0 asks for 1000 of the 600 training samples left after preprocessing",
        "Lower `val_set_size` (a share below 1, or a row count) or add data.",
    ),
    Entry(
        "data-mixed-formats",
        SECTION,
        "A dataset folder that mixes file formats",
        "the files mix formats (.csv, .jsonl). Put one format per dataset entry",
        "One dataset entry reads one format. Split the folder into one entry per format, or pick the files "
        "of one format with the entry's `data_files`.",
    ),
    Entry(
        "data-files-match-nothing",
        SECTION,
        "data_files that match no file",
        "datasets[0].data_files entry '*.parquet' matches no file in",
        "`data_files` patterns are matched inside the dataset's folder (`path`); fix the pattern or the "
        "folder.",
    ),
    Entry(
        "data-files-with-a-file",
        SECTION,
        "data_files with a path that is a file",
        "datasets[0].data_files selects files inside a folder; datasets[0].path is a file. Remove data_files.",
        "Point `path` at the folder and `data_files` at files in it, or remove `data_files`.",
    ),
    Entry(
        "data-split-missing",
        SECTION,
        "A saved dataset without the split asked for",
        "the saved dataset has no split 'validation' (it has train). Set datasets[0].split to one of them.",
        "The dataset was written with `save_to_disk`; set `split` to one of the splits the message lists.",
    ),
    Entry(
        "data-split-empty",
        SECTION,
        "A data file with a header but no rows",
        "split 'train' has no rows (the data holds none, or the split's slice selects none).",
        "The file (here a CSV file with only its header line) holds no rows; point the dataset at data with "
        "rows.",
    ),
    Entry(
        "tokenizer-without-eos",
        SECTION,
        "alpaca or completion data with a tokenizer that has no eos token",
        "The tokenizer has no eos token, which alpaca and completion rows end with.",
        "Each sample ends with the eos token so the model learns to stop. Use a tokenizer that defines "
        "`eos_token` (`tokenizer_config`), or add it to its tokenizer_config.json.",
    ),
    Entry(
        "pretokenized-not-a-list",
        SECTION,
        "A pretokenized row whose token ids are not a list",
        "row 0: field 'input_ids' is a str, not a list of token ids.",
        "pretokenized rows hold lists of ints; fix the row, or skip such rows with `skip_invalid_rows: true`.",
    ),
    Entry(
        "pretokenized-not-an-int",
        SECTION,
        "A pretokenized row with a token id that is not an int",
        "row 0: field 'input_ids' holds a float at position 0, not an int.",
        "Write token ids as integers (a JSON number with a fraction becomes a float for the whole column).",
    ),
    Entry(
        "pretokenized-out-of-vocabulary",
        SECTION,
        "A pretokenized row with a token id outside the vocabulary",
        "row 0: field 'input_ids' holds 99999 at position 2; token ids must be in 0..",
        "The rows were tokenized with another tokenizer than the recipe's (`tokenizer_config`, by default "
        "base_model's); tokenize them with the model's tokenizer.",
    ),
    Entry(
        "pretokenized-labels-length",
        SECTION,
        "A pretokenized row whose labels and token ids differ in length",
        "row 0: field 'labels' has 2 entries but input_ids has 3",
        "`labels` holds one entry per token (-100 for tokens not trained); fix the row or remove `labels`.",
    ),
    Entry(
        "pretokenized-attention-mask-padding",
        SECTION,
        "A pre-tokenized row whose attention_mask masks tokens (padding)",
        "row 0: field 'attention_mask' holds 0 at position 3: cptune attends to every token of a pre-tokenized "
        "row",
        "cptune reads Axolotl's pre-tokenized rows (`input_ids`, `labels`, `attention_mask`) but attends to "
        "every token of a row, so padding inside a row would be read as text. Remove the padding from the rows "
        "(cptune pads batches itself; `sample_packing: true` packs rows).",
    ),
    Entry(
        "data-without-type",
        SECTION,
        "A dataset without a type whose rows are not pre-tokenized",
        "alpaca.jsonl): no column 'input_ids' (it has 'instruction', 'input', 'output')",
        "A dataset entry without `type` holds pre-tokenized rows, as in Axolotl (before, cptune read it as "
        "alpaca). Set `type:` to the rows' format: `alpaca`, `chat_template` or `completion`.",
    ),
    Entry(
        "chat-message-not-an-object",
        SECTION,
        "A chat row whose messages are not objects",
        "row 0: field 'messages' message 0 is a str, not an object",
        'Each message is an object with a role and a content (`{"role": "user", "content": "Hi"}`).',
    ),
    Entry(
        "chat-message-without-role",
        SECTION,
        "A chat message without a role or content",
        "row 0: field 'messages' message 0 has no text 'role'",
        "Give every message a role and a text content, or set `message_field_role` / "
        "`message_field_content` to the keys your data uses.",
    ),
    Entry(
        "chat-reasoning-not-text",
        SECTION,
        "A chat message whose reasoning is not text",
        "row 0: field 'messages' message 1 has a 'reasoning_content' that is not text",
        "Give the reasoning as text (or leave it out), or set `field_thinking` to the key your data keeps it in.",
    ),
    Entry(
        "chat-eot-token-not-one-token",
        SECTION,
        "An end-of-turn token (eot_tokens) that is several tokens of the tokenizer",
        "tokens of the tokenizer, not one, so cptune cannot find it after a turn",
        "cptune trains the end-of-turn token found right after a message, so it must be one token, as in "
        "Axolotl. Add it with `tokens:` (or `special_tokens`), or list the token the chat template really ends "
        "a turn with (`<|im_end|>` for ChatML).",
    ),
    Entry(
        "chat-eot-eos-conflict",
        SECTION,
        "eot_tokens listing the eos token while train_on_eos and train_on_eot differ",
        "train_on_eot (none) say different things about it",
        "The eos token is then both an end-of-turn token and eos, and the two keys disagree on whether to train "
        "it (Axolotl refuses this too). Set `train_on_eos` and `train_on_eot` alike, or leave eos out of "
        "`eot_tokens`.",
    ),
    Entry(
        "chat-template-jinja-file-missing",
        SECTION,
        "chat_template_jinja naming a file that cannot be read",
        "chat_template_jinja: cannot read the template file",
        "Give the path of a readable `.jinja` file, or the template's text itself.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = (
    Documented(
        "data-file-unreadable",
        SECTION,
        "A data file this user may not read",
        "cannot be read (no read permission for this user)",
        "Make the file readable (`chmod +r`), or point the dataset at a copy you can read. "
        "`cptune validate` lists it with the recipe's other problems.",
        raised_in="src/cptune/data/sources.py",
        why_not_in_catalogue="the catalogue runs as root in CI, for whom no permission bit hides a file",
        tested_by="tests/run/test_cli_errors.py::test_validate_reports_missing_and_unreadable_data_with_the_other_problems",
    ),
)
