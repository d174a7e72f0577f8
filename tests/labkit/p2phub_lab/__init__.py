"""The p2phub lab, kept outside the product package: the runner behind tools/lab,
the script that sets the VM up (guest.sh), the lab env file reader and the
kernel-log scanner. Standard library only, so tools/lab runs without the venv."""
