"""Corpus cleaning for the demo target: license headers, near-duplicates, function examples."""
import ast
import json

from peagle.data.clean import function_examples, near_duplicates, strip_license_header


def test_license_comment_header_is_stripped_and_code_kept():
    src = "#!/usr/bin/env python\n# Copyright 2020 Someone\n# Licensed under the MIT license\n\nimport os\nx = 1\n"
    assert strip_license_header(src) == "#!/usr/bin/env python\nimport os\nx = 1\n"


def test_ordinary_comments_and_docstrings_are_kept():
    src = '# A helper module for parsing.\n"""Parse things."""\nimport os\n'
    assert strip_license_header(src) == src
    once = '"""Parse license files."""\nimport os\n'          # one mention is a topic, not a license notice
    assert strip_license_header(once) == once
    doc = '"""Utilities.\n\nCopyright (c) 2001 PSF. Licensed under the PSF license.\n"""\nimport os\n'
    assert strip_license_header(doc) == "import os\n"


def test_near_duplicates_finds_edited_copy_not_different_file():
    src = open(json.__file__.replace("__init__.py", "encoder.py")).read()
    lines = src.splitlines()
    lines[50] = "x = 12345"
    other = open(json.__file__.replace("__init__.py", "decoder.py")).read()
    assert near_duplicates([src, "\n".join(lines), other, src[: len(src) // 3]]) == {1}


def test_function_examples_are_standalone_parsable_with_docstring_and_body():
    src = (
        "class A:\n"
        "    def method(self, x):\n"
        '        """Double x."""\n'
        "        y = x * 2\n"
        "        return y\n"
        "\n"
        "def short(x):\n"
        '    """Too short."""\n'
        "    return x\n"
        "\n"
        "def nodoc(x):\n"
        "    y = x\n"
        "    return y\n"
    )
    ex = function_examples(src)
    assert ex == ['def method(self, x):\n    """Double x."""\n    y = x * 2\n    return y\n']
    fn = ast.parse(ex[0]).body[0]
    assert ast.get_docstring(fn) == "Double x."
    assert function_examples("def broken(:\n") == []
