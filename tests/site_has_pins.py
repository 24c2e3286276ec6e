"""Exit 0 when every ``name==version`` pin of a requirements file is installed in a ``--target``
directory (read from its metadata alone, importing nothing), else 1: how the test-support install
scripts (tests/swift/install.sh, tests/trl/install.sh, tests/numpy1/install.sh) tell that their site is already there.

    python tests/site_has_pins.py TARGET REQUIREMENTS
"""

import sys
from importlib.metadata import distributions

from packaging.utils import canonicalize_name


def main(target: str, requirements: str) -> int:
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions(path=[target])}
    for line in open(requirements):
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            if have.get(canonicalize_name(name)) != version:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
