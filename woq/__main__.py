from woq.cli import app

app()
