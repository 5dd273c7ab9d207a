"""The app's pages, one module each; ``app/main.py`` lists them."""
