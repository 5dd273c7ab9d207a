"""The Streamlit explorer: ``streamlit run app/main.py``, organised by feature.

core/     what every page stands on: settings (environment), models (the model cache), traces (the
          trace store and TraceKey), session (one browser session, View), links (the URL), pages
          (the page list), errors
topics/   one module per topic, its data shaping (no Streamlit) and its figures together: model_map,
          residual, predictions, attention, router, experts, interventions, export, cards (content)
          and card_plots (each card's live plot); tokens, arrays, figures and margins are shared by them
ui/       the Streamlit pieces pages share: widgets, card_view (the component cards), comparison (two
          runs side by side), prefetch (the browser fetches plotly.js while the first run loads torch)
views/    the pages, which only lay out widgets (app.core.pages lists them; no page imports another)
main.py routes; sidebar.py draws the sidebar; plots.py draws the app's figures outside it (a notebook).
"""
