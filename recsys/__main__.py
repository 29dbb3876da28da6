from recsys.cli import entry

entry()
