import sys

from megatron_flops.cli import main

sys.exit(main())
