"""Each pshard command's getopt table gives every long option its own code: two options
with one code make one flag act as the other (as `--join` once read as `--http-host`).
The tables are read from src/cli/*.c, with the option macros they use expanded."""
import collections
import glob
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OPTION = re.compile(r'\{"([\w-]+)",\s*\w+,\s*(?:0|NULL),\s*\'(.)\'\}')


def tables():
    files = glob.glob(os.path.join(ROOT, "src", "cli", "*.c"))
    macros = {}
    for f in files + glob.glob(os.path.join(ROOT, "src", "cli", "*.h")):
        for m in re.finditer(r'#define\s+(\w+_LONG_OPTS)\s*((?:.*\\\n)*.*)', open(f).read()):
            macros[m.group(1)] = m.group(2).replace("\\\n", " ")
    for f in files:
        src = open(f).read()
        for m in re.finditer(r'struct option \w+\[\]\s*=\s*\{(.*?)\{0, 0, 0, 0\}\}', src, re.S):
            body = m.group(1)
            for name, text in macros.items():
                body = body.replace(name, text)
            line = src[:m.start()].count("\n") + 1
            yield f"{os.path.basename(f)}:{line}", OPTION.findall(body)


def test_every_long_option_of_a_command_has_its_own_code():
    found = list(tables())
    # every table of the commands (scheduler, server, run, exec, stats, top, checkpoint)
    assert len(found) >= 7, found
    for where, opts in found:
        assert opts, where
        names = [n for n, _ in opts]
        assert len(names) == len(set(names)), (where, names)
        by_code = collections.defaultdict(list)
        for name, code in opts:
            by_code[code].append(name)
        clashes = {c: n for c, n in by_code.items() if len(n) > 1}
        assert not clashes, f"{where}: options sharing a code: {clashes}"
