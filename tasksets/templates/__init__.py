"""Training templates (splits `train` and `eval_id`): files, text processing, archives,
permissions, find, checksums, arithmetic and JSON. Easy ones first: a 135M model should solve
some of them sometimes (count lines of a file, read a value, shell arithmetic).

Every expected answer is computed here in Python from the values the template chose.

The builders live by family: text.py (one text file), data.py (arithmetic, CSV, JSON), files.py
(the file system and archives), file_state.py (graded on the workspace). They are registered
below, in the order the generator takes them round-robin: reordering these lines changes every
generated split.
"""

from __future__ import annotations

from tasksets.instances import template
from tasksets.templates import data, file_state, files, text

template("count_lines", "easy")(text.count_lines)
template("read_config_value", "easy")(text.read_config_value)
template("shell_arithmetic", "easy")(data.shell_arithmetic)
template("count_files", "easy")(files.count_files)
template("line_n", "easy")(text.line_n)
template("word_count", "easy")(text.word_count)
template("grep_count", "medium")(text.grep_count)
template("count_unique", "medium")(text.count_unique)
template("most_frequent", "medium")(text.most_frequent)
template("csv_column_sum", "medium")(data.csv_column_sum)
template("write_text_file", "easy", kind="file_state")(file_state.write_text_file)
template("replace_word", "medium", kind="file_state")(file_state.replace_word)
template("make_executable", "easy", kind="file_state")(file_state.make_executable)
template("tar_directory", "medium", kind="file_state")(file_state.tar_directory)
template("find_by_extension", "medium")(files.find_by_extension)
template("file_checksum", "medium")(files.file_checksum)
template("json_field", "medium")(data.json_field)
template("largest_file", "medium")(files.largest_file)
template("mkdir_nested", "easy", kind="file_state")(file_state.mkdir_nested)
template("count_matching_users", "easy")(text.count_matching_users)
template("archive_sum", "hard")(files.archive_sum)
template("top_words", "hard")(text.top_words)
template("cat_file", "easy")(text.cat_file)
