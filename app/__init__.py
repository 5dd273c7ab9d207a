"""The Streamlit explorer: ``streamlit run app/main.py``, organised by feature.

core/     what every page stands on: settings (environment), models (the model cache), traces (the
          trace store and TraceKey), session (one browser session, View), errors
topics/   one module per topic, its data shaping (no Streamlit) and its figures together: model_map,
          residual, predictions, attention, router, experts, interventions, export, cards (content)
          and card_plots (each card's live plot); tokens, arrays, figures and margins are shared by them
views/    the pages, which only lay out widgets (app.pages lists them; no page imports another)
main.py routes (prefetch.py has the browser fetch plotly.js while the first run loads torch);
sidebar.py, widgets.py, card_view.py and comparison.py are Streamlit pieces pages share.
"""
