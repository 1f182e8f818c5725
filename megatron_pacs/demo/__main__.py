"""``python -m megatron_pacs.demo``: see :mod:`megatron_pacs.demo.run`."""

import sys

from megatron_pacs.demo.run import main

sys.exit(main())
