"""What `infinity train` feeds and watches: data, held-out evaluation, the metrics log."""
