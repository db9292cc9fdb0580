"""The engine side: the engines a trainer drives, the scheduler, requests, step reports."""
