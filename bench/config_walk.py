"""The walk of a stage's config through the code: which source files read the config, in the order they read it.

    python3 bench/config_walk.py --out walk-eval.json -- eval --drafter scratch --set eval.engine=null

Runs `eagle3ops ARGS...` in this process with every read of a config field (config.Section's attributes: the typed
params.yaml, the stage's view of it included) recorded with the eagle3ops file that made it. The walk is that sequence of files with repeats in a row collapsed; a
"return" is a step back into a file the walk had already left. Few files and few returns: a reader following the
config from the stage finds each setting's use in one place. Prints the figures and writes the walk as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import eagle3ops

PACKAGE = str(Path(eagle3ops.__file__).parent)  # the package this Python imports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON written")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the eagle3ops command's arguments")
    args = parser.parse_args()
    reads: list[str] = []

    from eagle3ops.config import Section
    from eagle3ops.tracking import stage_view

    def recording(read):
        def __getattribute__(section, name):
            if not name.startswith("_"):
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(PACKAGE):
                    reads.append(caller.removeprefix(PACKAGE + "/"))
            return read(section, name)
        return __getattribute__

    Section.__getattribute__ = recording(object.__getattribute__)
    guarded = stage_view._guarded  # the stage's view: each section a subclass with its own __getattribute__

    def guarded_and_recorded(section_type):
        view = guarded(section_type)
        if "_walk_recorded" not in vars(view):
            view.__getattribute__, view._walk_recorded = recording(vars(view)["__getattribute__"]), True
        return view

    stage_view._guarded = guarded_and_recorded
    from eagle3ops.cli import main as eagle3ops

    command = [arg for arg in args.command if arg != "--"]
    try:
        code = eagle3ops(command)
    except SystemExit as exit_:
        code = exit_.code
    walk = [file for i, file in enumerate(reads) if i == 0 or reads[i - 1] != file]
    returns = sum(file in walk[:i - 1] for i, file in enumerate(walk) if i > 1)
    result = {"command": ["eagle3ops", *command], "exit": code, "reads": len(reads), "files": len(set(walk)),
              "steps": len(walk), "returns": returns, "walk": walk}
    print(f"eagle3ops {' '.join(command)}: {len(reads)} reads of the config from {len(set(walk))} files; the walk "
          f"takes {len(walk)} steps, {returns} of them back into a file it had left")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
