"""dscache-stage: copy an S3 prefix onto local disk, safely and fast."""
