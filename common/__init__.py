"""What the web process and the inference worker share, free of torch: the job protocol over Redis, the
events and sampling parameters it carries, model names, chat templates, environment parsing and logs.

The web image installs no torch, so nothing here may import it (tests/web/test_no_torch.py checks).
"""
