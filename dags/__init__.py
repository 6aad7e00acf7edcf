"""dags"""
