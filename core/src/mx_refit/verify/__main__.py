"""``python -m mx_refit.verify ...`` runs ``mx-refit verify``."""

import sys

from mx_refit.verify.tool import verify_main

sys.exit(verify_main(sys.argv[1:]))
